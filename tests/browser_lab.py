"""Drive a notebook in real JupyterLab from headless Chromium (used by ``tests/test_browser.py``).

``LabServer`` starts ``jupyter lab`` on 127.0.0.1 on a free port with a random token, with its own
settings/workspace directories (no news popup, every cell rendered), and always stops it: the
server's process group *and* its kernels (which run in their own sessions) are killed on ``stop()``,
on leaving the ``with`` block, at interpreter exit and on SIGTERM. ``LabPage`` opens a notebook, runs all cells
through the menus, waits for the kernel and reads the notebook model for errors.

Chromium is Debian's (``/usr/bin/chromium``, or ``$OOMKIT_CHROMIUM``), launched by Playwright with a
fresh profile; Playwright's own browser download is never used.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = os.environ.get("OOMKIT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often have a 64 MB /dev/shm
]
# JupyterLab user settings: no news/update popups over the notebook; render every cell (Lab 4
# otherwise virtualizes off-screen cells, so their outputs would not be in the DOM).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_requirements() -> list[str]:
    """What ``make test-browser`` would have to install before the browser tests can run."""
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"Chromium ({CHROMIUM}; `apt-get install chromium`)")
    for module, pkg in (
        ("playwright", "playwright"),
        ("jupyterlab", "jupyterlab"),
        ("jupyterlab_widgets", "jupyterlab_widgets"),
    ):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{pkg} (pip install -r requirements-browser.txt)")
    return missing


class LabServer:
    """A JupyterLab server serving ``root``; use as a context manager (always stopped).

    Args:
        root: the directory the server serves (and where kernels start).
        log: file that receives the server's output (read it when a test fails).
        env: extra environment for the server and its kernels (e.g. ``PYTHONPATH``).
        startup_timeout: seconds to wait for ``/api/status`` to answer.
        python: the interpreter that runs JupyterLab (another environment's, for JupyterLab 3).
        kernel_python: the interpreter of the ``python3`` kernel (default: the server's own).
    """

    def __init__(
        self,
        root: Path,
        log: Path,
        env: dict | None = None,
        startup_timeout: float = 120,
        python: str = sys.executable,
        kernel_python: str | None = None,
    ):
        self.root, self.log, self.env, self.startup_timeout = Path(root), Path(log), env or {}, startup_timeout
        self.python, self.kernel_python = str(python), kernel_python
        self.port = 0
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self._state: str | None = None
        self._seen: dict[int, object] = {}  # pid -> psutil.Process of the server and everything it started
        self._old_sigterm = None

    def url(self, path: str = "lab") -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}{sep}token={self.token}"

    def start(self) -> LabServer:
        self._state = tempfile.mkdtemp(prefix="oomkit-lab-")
        state = Path(self._state)
        for rel, values in LAB_SETTINGS.items():
            f = state / "settings" / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(values))
        env = {
            **os.environ,
            **self.env,
            "JUPYTER_CONFIG_DIR": str(state / "config"),
            "JUPYTER_RUNTIME_DIR": str(state / "runtime"),
            "JUPYTER_PLATFORM_DIRS": "1",
        }
        if self.kernel_python:  # a kernelspec found before the server's own (JUPYTER_PATH comes first)
            spec = state / "data" / "kernels" / "python3"
            spec.mkdir(parents=True)
            argv = [self.kernel_python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            spec.joinpath("kernel.json").write_text(
                json.dumps({"argv": argv, "display_name": "Python 3 (ipykernel)", "language": "python"})
            )
            env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(state / "data"), os.environ.get("JUPYTER_PATH")]))
        self.port = free_port()
        cmd = [
            self.python,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--port-retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.allow_remote_access=False",
            f"--LabApp.user_settings_dir={state / 'settings'}",
            f"--LabApp.workspaces_dir={state / 'workspaces'}",
            "--LabApp.expose_app_in_browser=True",
        ]
        if self.lab_major() >= 4:  # no news or update checks (JupyterLab 3 has neither setting)
            cmd += ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root; Jupyter refuses otherwise
            cmd.append("--allow-root")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            # New session: stop() can kill the whole process group at once.
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        atexit.register(self.stop)
        self._stop_on_sigterm()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"JupyterLab did not answer within {self.startup_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def lab_major(self) -> int:
        """The major version of the JupyterLab that ``python`` runs."""
        out = subprocess.run(
            [self.python, "-c", "import jupyterlab; print(jupyterlab.__version__)"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return int(out.stdout.split(".")[0])

    def _stop_on_sigterm(self) -> None:
        """``timeout`` (the Makefile's bound) sends SIGTERM, which skips atexit: stop the server first."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self.stop()
            raise SystemExit(128 + signum)

        self._old_sigterm = signal.signal(signal.SIGTERM, handler)

    def track(self) -> None:
        """Remember the server's descendants now (kernels run in their own sessions)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self._seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> None:
        """Stop the server, its process group and its kernels; safe to call twice."""
        import psutil

        if self.proc is not None:
            self.track()
            if self.proc.poll() is None:
                try:  # SIGTERM first: the server shuts its kernels down cleanly
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=15)
            for p in self._seen.values():  # anything that outlived the group (kernels)
                try:
                    if p.is_running():  # psutil checks the pid was not reused
                        p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(list(self._seen.values()), timeout=10)
            self.proc = None
        if self._state:
            shutil.rmtree(self._state, ignore_errors=True)
            self._state = None
        atexit.unregister(self.stop)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> LabServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def chromium_page(viewport=(1280, 1000)):
    """A Playwright page in Debian's Chromium with a fresh profile; closed (and the profile removed) after."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="oomkit-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": viewport[0], "height": viewport[1]},
            device_scale_factor=1,
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            yield page
        finally:
            context.close()


# Read the open notebook through the app JupyterLab exposes with expose_app_in_browser: the
# kernel's status and the notebook model as nbformat JSON (outputs included).
_JS_STATE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.content || !w.content.model || !w.sessionContext) return null;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  return {kernel: k ? k.status : null, path: w.context ? w.context.path : null,
          notebook: w.content.model.toJSON()};
}"""


class LabPage:
    """One notebook open in JupyterLab in a Playwright page."""

    def __init__(self, page, server: LabServer):
        self.page, self.server = page, server
        self.name: str | None = None

    def open(self, name: str, timeout: float = 120) -> LabPage:
        self.page.goto(self.server.url(f"lab/tree/{name}"), timeout=timeout * 1000)
        # :visible: notebooks an earlier test opened stay open (hidden tabs) in the restored workspace
        self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").first.wait_for(timeout=timeout * 1000)
        self.name = name
        # A restored workspace may show another notebook first: wait until ours is the current one.
        self.wait_kernel("idle", timeout)
        self.server.track()
        return self

    def state(self) -> dict | None:
        """The current notebook's kernel status and JSON; None until the notebook we opened is current."""
        s = self.page.evaluate(_JS_STATE)
        if s and self.name and s.get("path") and Path(s["path"]).name != Path(self.name).name:
            return None
        return s

    def wait_kernel(self, status: str = "idle", timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if s and s["kernel"] == status:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"kernel not {status} after {timeout:.0f} s (last: {s and s['kernel']})")
            time.sleep(0.25)

    def menu(self, top: str, item: str) -> None:
        """Click a menu-bar entry, then an item of its menu (real mouse clicks)."""
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(top)}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()

    def run_all(self, timeout: float = 300) -> dict:
        """Run > Run All Cells, wait until every code cell has run and the kernel is idle; the notebook JSON."""
        self.menu("Run", "Run All Cells")
        clicked = time.monotonic()
        deadline = clicked + timeout
        while True:
            s = self.state()
            if s:
                code = [c for c in s["notebook"]["cells"] if c["cell_type"] == "code"]
                if s["kernel"] == "idle" and all(c.get("execution_count") for c in code):
                    return s["notebook"]
                if errors(s["notebook"]):  # Run All stops at the first error
                    return s["notebook"]
                # A click that landed while the page was still settling runs nothing: an idle kernel and
                # no cell run or queued 10 s later means the command never started, so click again.
                queued = self.page.locator(".jp-NotebookPanel:visible .jp-InputPrompt", has_text="[*]").count()
                if (
                    s["kernel"] == "idle"
                    and not queued
                    and time.monotonic() - clicked > 10
                    and not any(c.get("execution_count") for c in code)
                ):
                    self.menu("Run", "Run All Cells")
                    clicked = time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"cells still running after {timeout:.0f} s")
            time.sleep(0.5)

    def screenshot(self, path: Path, locator=None) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        (locator or self.page).screenshot(path=str(path))
        return path


def errors(nb: dict) -> list[str]:
    """``ename: evalue`` of every error output in a notebook (nbformat JSON)."""
    return [
        f"{o.get('ename')}: {o.get('evalue')}"
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]


def output_text(cell: dict) -> str:
    """All text a code cell displayed (streams, text/plain and text/html)."""
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append("".join(o.get("text", "")))
        for mime in ("text/plain", "text/html"):
            v = o.get("data", {}).get(mime)
            if v:
                parts.append("".join(v) if isinstance(v, list) else v)
    return "\n".join(parts)


def parameterized_copy(notebook: Path, parameters: dict, dest_dir: Path) -> Path:
    """Copy ``notebook`` into ``dest_dir`` with papermill's injected-parameters cell (as papermill runs it)."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(notebook))  # as papermill reads it (every cell gets metadata.tags)
    nb = parameterize_notebook(nb, parameters)
    nb.metadata.pop("jupytext", None)  # no pairing in the scratch copy: the server must not write .py files
    nb.metadata.pop("papermill", None)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / notebook.name
    nbformat.write(nb, out)
    return out
