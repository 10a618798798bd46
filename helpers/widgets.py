"""The load panel: choose load mode, ``max_new_tokens`` and batch with widgets, see the fit at once, load.

``LoadPanel(model)`` shows a dropdown, a checkbox and sliders; every change re-estimates memory
(cached: the model's layout is counted once on the meta device, and each setting combination is
computed once), redraws a bar of the breakdown against the device, states the fit verdict and the
top fix, and ``panel.plan`` is always the matching :class:`~helpers.loading.LoadPlan`. Without a
widget front end (papermill, plain Python, no ipywidgets) the panel is a printed summary and the
notebook's parameters decide.

DOM hooks for browser tests: every control has a stable ``description`` ("Load mode", "Double
quant", "max_new_tokens", "Batch size", "Prompt tokens", button "Load") and CSS classes
``oomkit-panel``, ``oomkit-estimate`` (the bar), ``oomkit-verdict`` (verdict + fix text, with
``data-verdict``), ``oomkit-load`` (button) and ``oomkit-report`` (output after loading).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from html import escape
from typing import Any

from .devices import resolve_device
from .estimator import fit, resolve_config
from .html import COLORS
from .loading import LoadError, LoadPlan, load
from .memory import ram_readout
from .oom import is_oom
from .reclaim import unload
from .session import enable_colab_widgets
from .units import format_bytes
from .vocab import FITS, FOUR_BIT, LOAD_MODES, VERDICT_STATUS, verdict

__all__ = ["Control", "LoadPanel", "Panel", "PanelState", "widget_bundle", "widgets_available"]

SEGMENTS = [  # (label, estimate row groups, opacity) in bar order; a load panel has no training state
    ("weights", ("weights",), 1.0),
    ("KV cache", ("kv_cache",), 0.7),
    ("activations", ("activations",), 0.5),
    ("overheads", ("training", "overhead"), 0.3),
]
MAX_NEW_TOKENS_RANGE = (16, 4096, 16)  # min, max, step: every multiple of 16, so 16/32/64 are reachable
PROMPT_TOKENS_RANGE = (16, 8192, 16)
BATCH_RANGE = (1, 64, 1)


def _ipywidgets():
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


def _weights_key(plan: LoadPlan) -> LoadPlan:
    """The plan without its generation budget: what decides the loaded weights."""
    return dataclasses.replace(plan, max_new_tokens=0, batch_size=1, prompt_tokens=1)


def widgets_available() -> bool:
    """True inside an IPython kernel with ipywidgets installed (a front end may still be absent)."""
    if _ipywidgets() is None:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


# The ipywidgets 7 view reference, as its ``Widget._ipython_display_`` sends it (7.x widgets have no
# ``_repr_mimebundle_``; 8.x builds the same dict there).
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


def widget_bundle(widget, include=None, exclude=None) -> dict:
    """The display bundle of an ipywidget, for ipywidgets 8 and for the 7.7 that Colab preinstalls."""
    if hasattr(widget, "_repr_mimebundle_"):
        bundle = widget._repr_mimebundle_(include=include, exclude=exclude)
        return dict(bundle[0] if isinstance(bundle, tuple) else bundle)  # (data, metadata) or data
    bundle = {"text/plain": repr(widget)}
    if getattr(widget, "_view_name", None) is not None:
        bundle[WIDGET_VIEW_MIME] = {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}
    return bundle


@dataclass
class PanelState:
    """What the panel shows for one setting: the estimate, the verdict, the top fix, how long it took."""

    plan: LoadPlan
    estimate: Any
    verdict: str
    capacity: int
    device: str
    suggestion: Any = None
    seconds: float = 0.0
    cached: bool = False
    segments_spec: tuple = tuple(SEGMENTS)  # (label, estimate row groups, opacity) per bar segment

    @property
    def headroom(self) -> int:
        return self.capacity - self.estimate.total

    def _named_device(self) -> bool:
        """False when the device is a bare byte count: its label is the capacity, shown once already."""
        return self.device != format_bytes(self.capacity)

    def _on(self, html: bool = False) -> str:
        device = escape(self.device) if html else self.device
        return f" on {device}" if self._named_device() else ""

    def segments(self) -> list[tuple[str, int]]:
        """Bytes per bar segment (weights, KV cache, activations, overheads for a load panel)."""
        return [(label, sum(self.estimate.group_bytes(g) for g in groups)) for label, groups, _ in self.segments_spec]

    def verdict_text(self) -> str:
        text = (
            f"{self.verdict.upper()}: {format_bytes(self.estimate.total)} of {format_bytes(self.capacity)}"
            f"{self._on()} (headroom {format_bytes(self.headroom)})"
        )
        if self.suggestion is not None:
            text += f". Top fix: {self.suggestion.change} (saves {format_bytes(self.suggestion.saving)}{self._short()})"
        return text

    def _short(self) -> str:
        """Said after a top fix that does not make the plan fit by itself (no single change does)."""
        after = verdict(self.suggestion.estimate.total, self.capacity)
        return "" if after == FITS else f"; still {after}: not enough alone"

    def bar_html(self, width: int = 420) -> str:
        color = COLORS[VERDICT_STATUS[self.verdict]]
        scale = max(self.capacity, self.estimate.total) or 1
        spans, legend = [], []
        for (label, nbytes), (_, _, alpha) in zip(self.segments(), self.segments_spec, strict=True):
            pct = 100 * nbytes / scale
            spans.append(
                f"<span title='{escape(label)} {format_bytes(nbytes)}' style='display:block;float:left;"
                f"width:{pct:.2f}%;height:100%;background:{color};opacity:{alpha}'></span>"
            )
            # nowrap: a narrow output area wraps between items, never between a label and its size
            legend.append(
                f"<span style='white-space:nowrap'><span style='opacity:{max(alpha, 0.5)}'>&#9632;</span> "
                f"{escape(label)} {format_bytes(nbytes)}</span>"
            )
        cap_mark = 100 * self.capacity / scale
        return (
            "<div style='font-family:monospace'>"
            f"<div style='position:relative;width:{width}px;height:14px;background:#e8eaed;border-radius:3px;"
            f"overflow:hidden'>{''.join(spans)}"
            f"<span style='position:absolute;left:{cap_mark:.2f}%;top:0;width:2px;height:100%;background:#202124'>"
            "</span></div>"
            f"<div style='color:{color}'>{' &nbsp; '.join(legend)}</div>"
            f"<div>total {format_bytes(self.estimate.total)} / {format_bytes(self.capacity)}"
            f"{f' ({escape(self.device)})' if self._named_device() else ''}</div></div>"
        )

    def verdict_html(self) -> str:
        color = COLORS[VERDICT_STATUS[self.verdict]]
        fix = ""
        if self.suggestion is not None:
            fix = (
                f"<div class='oomkit-suggestion'>Top fix: <b>{escape(self.suggestion.change)}</b> "
                f"(saves {format_bytes(self.suggestion.saving)}{escape(self._short())})</div>"
            )
        return (
            f"<div class='oomkit-verdict-text' data-verdict='{escape(self.verdict)}' "
            f"style='font-family:monospace'><b style='color:{color}'>{escape(self.verdict.upper())}</b>: "
            f"{format_bytes(self.estimate.total)} of {format_bytes(self.capacity)}{self._on(html=True)} "
            f"(headroom {format_bytes(self.headroom)}){fix}</div>"
        )


@dataclass(frozen=True)
class Control:
    """One panel control: the plan field it sets, its label, and its widget."""

    key: str
    description: str
    kind: str  # "dropdown", "checkbox" or "slider"
    choices: tuple = ()  # the dropdown's options, or a slider's (min, max, step)


def _resolve_panel_device(device: Any) -> tuple[int, str, Any]:
    """(capacity bytes, label, device argument for the estimator)."""
    import torch

    if device == "current" and not torch.cuda.is_available():
        return ram_readout().available, "CPU RAM (no GPU)", "cpu"
    label, dev = resolve_device(device)
    if dev is None:  # "cpu": compare with this machine's free RAM, as "current" does without a GPU
        return ram_readout().available, "CPU RAM", "cpu"
    return dev["capacity"], label, device


class Panel:
    """Widgets that set some fields of a plan and show, at every change, whether the plan fits.

    Subclasses name their ``CONTROLS``, build the plan for given values (:meth:`plan_for`) and estimate it
    (:meth:`estimate_plan`). Each setting is estimated once (cached); the model's config is read once
    and the estimator caches its meta-device layout, so a slider move only redoes arithmetic.
    """

    TITLE = "oomkit panel"
    CONTROLS: tuple[Control, ...] = ()
    SEGMENTS = SEGMENTS

    def __init__(self, model: str, device: Any, values: dict, widgets: bool | None = None):
        self.model = str(model)
        self.device = device
        self._config = resolve_config(self.model)[0]
        self._capacity, self._device_label, self._est_device = _resolve_panel_device(device)
        self._cache: dict[tuple, PanelState] = {}
        self._values = dict(values)
        self._quiet = False
        self.plan_for(self._values)  # a bad starting value fails here, before any widget exists
        use = widgets_available() if widgets is None else widgets
        self.controls: dict[str, Any] | None = self._build() if use and _ipywidgets() is not None else None
        self.state = self.refresh()

    @property
    def config(self):
        """The model's config, read once (estimates reuse it)."""
        return self._config

    @property
    def estimate_device(self) -> Any:
        """The device argument the estimates use ("cpu" when comparing with this machine's RAM)."""
        return self._est_device

    @property
    def device_label(self) -> str:
        """How the panel names its device ("t4", "CPU RAM (no GPU)", ...)."""
        return self._device_label

    # -- what a subclass decides ------------------------------------------------------------------

    def plan_for(self, values: dict):
        """The plan these control values stand for (raises on an invalid value)."""
        raise NotImplementedError

    def estimate_plan(self, plan):
        """The memory estimate of ``plan`` on the panel's device."""
        raise NotImplementedError

    def disabled(self) -> set[str]:
        """Controls that mean nothing for the current values (greyed out)."""
        return set()

    def cache_key(self) -> tuple:
        """What decides the estimate; settings with the same key share one."""
        return tuple(self._values[c.key] for c in self.CONTROLS)

    def extra_widgets(self, w) -> list:
        """Widgets under the verdict (LoadPanel's Load button and report)."""
        return []

    def notes(self) -> list[str]:
        """Lines the summary adds after the estimate's own warnings."""
        return []

    # -- widgets ----------------------------------------------------------------------------------

    def _control_widget(self, w, control: Control):
        style = {"description_width": "initial"}
        value = self._values[control.key]
        if control.kind == "dropdown":
            return w.Dropdown(options=list(control.choices), value=value, description=control.description, style=style)
        if control.kind == "checkbox":
            return w.Checkbox(value=value, description=control.description, indent=False)
        lo, hi, step = control.choices
        return w.IntSlider(
            value=value, min=min(lo, value), max=max(hi, value), step=step, description=control.description,
            continuous_update=True, style=style, layout=w.Layout(width="480px"),
        )  # fmt: skip

    def _build(self) -> dict[str, Any]:
        w = _ipywidgets()
        enable_colab_widgets()  # done at import already; again in case helpers.widgets came first
        c = {control.key: self._control_widget(w, control) for control in self.CONTROLS}
        for widget in c.values():
            widget.observe(self._on_change, names="value")
        c["estimate"], c["verdict"] = w.HTML(), w.HTML()
        c["estimate"].add_class("oomkit-estimate")
        c["verdict"].add_class("oomkit-verdict")
        rows, pending = [], []  # a checkbox sits beside the dropdown before it
        for control in self.CONTROLS:
            if control.kind == "checkbox" and pending:
                pending.append(c[control.key])
                continue
            if pending:
                rows.append(w.HBox(pending) if len(pending) > 1 else pending[0])
            pending = [c[control.key]]
        if pending:
            rows.append(w.HBox(pending) if len(pending) > 1 else pending[0])
        title = w.HTML(f"<b>{escape(self.TITLE)}</b>: {escape(self.model)}")
        extra = self.extra_widgets(w)
        c["box"] = w.VBox([title, *rows, c["estimate"], c["verdict"], *extra])
        c["box"].add_class("oomkit-panel")
        return c

    def _on_change(self, change) -> None:
        owner = change["owner"]
        key = next(k for k, wdg in self.controls.items() if wdg is owner)
        self._values[key] = change["new"]
        if not self._quiet:
            self.refresh()

    # -- the plan and its estimate ----------------------------------------------------------------

    @property
    def plan(self):
        """The plan matching the current widget values."""
        return self.plan_for(self._values)

    @property
    def values(self) -> dict:
        """The controls' current values."""
        return dict(self._values)

    def set(self, **values) -> PanelState:
        """Change panel values from code (``panel.set(load="int8")``); one refresh for all of them."""
        unknown = set(values) - set(self._values)
        if unknown:
            raise TypeError(f"unknown panel value(s) {sorted(unknown)}; valid: {sorted(self._values)}")
        self.plan_for({**self._values, **values})  # validate before changing anything
        if self.controls is not None:
            self._quiet = True
            try:
                for k, v in values.items():
                    control = self.controls[k]
                    if hasattr(control, "min") and isinstance(v, int):  # a slider: widen it, as __init__ does
                        control.max, control.min = max(control.max, v), min(control.min, v)
                    control.value = v
            finally:
                self._quiet = False
        self._values.update(values)
        return self.refresh()

    def compute(self, plan=None, *, use_cache: bool = True) -> PanelState:
        """Estimate and judge ``plan`` (default: the current one); cached per setting."""
        started = time.perf_counter()
        key = self.cache_key() if plan is None else None  # only the panel's own settings are cached
        plan = plan or self.plan
        if use_cache and key in self._cache:
            return self._cache[key]
        est = self.estimate_plan(plan)
        result = verdict(est.total, self._capacity)
        suggestion = None
        if result != FITS:
            target = self._capacity if self._est_device == "cpu" else self._est_device
            sugg = fit(est, target).suggestions
            suggestion = sugg[0] if sugg else None
        state = PanelState(
            plan, est, result, self._capacity, self._device_label, suggestion, time.perf_counter() - started,
            segments_spec=self.SEGMENTS,
        )  # fmt: skip
        if use_cache and key is not None:
            self._cache[key] = state
        return state

    def refresh(self) -> PanelState:
        """Recompute (or fetch) the state for the current values and redraw the widgets."""
        started = time.perf_counter()
        cached = self.cache_key() in self._cache
        state = self.compute()
        if self.controls is not None:
            c = self.controls
            off = self.disabled()
            for control in self.CONTROLS:
                c[control.key].disabled = control.key in off
            c["estimate"].value = state.bar_html()
            c["verdict"].value = state.verdict_html()
        state.cached = cached
        state.seconds = time.perf_counter() - started
        self.state = state
        return state

    # -- display ----------------------------------------------------------------------------------

    def summary(self) -> str:
        s = self.state
        segs = ", ".join(f"{label} {format_bytes(b)}" for label, b in s.segments())
        lines = [f"{self.TITLE}: {self.model}", f"  plan: {self.plan}", f"  estimate: {segs}", f"  {s.verdict_text()}"]
        lines += [f"  note: {m}" for m in [*s.estimate.warnings, *self.notes()]]
        if self.controls is None:
            lines.append("  (no widgets here: the parameters cell decides; change values with panel.set(...))")
        return "\n".join(lines)

    __str__ = summary

    def __repr__(self) -> str:
        return self.summary()

    def _repr_mimebundle_(self, include=None, exclude=None):
        if self.controls is not None:
            return {**widget_bundle(self.controls["box"], include, exclude), "text/plain": self.summary()}
        html = (
            f"<div style='font-family:monospace'><b>{escape(self.TITLE)}</b>: {escape(self.model)}<br>"
            f"{escape(str(self.plan))}</div>" + self.state.bar_html() + self.state.verdict_html()
        )
        return {"text/plain": self.summary(), "text/html": html}

    def show(self) -> None:
        """Display the panel in a notebook, or print the summary in plain Python."""
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            print(self.summary())
            return
        if get_ipython() is None:
            print(self.summary())
        else:
            display(self)


class LoadPanel(Panel):
    """Widgets that build a :class:`LoadPlan`, show whether it fits, and load it with one click.

    Args:
        model: hub id, shipped config name or local directory (only its config is read here).
        device: ``"current"`` (this GPU; without one, this machine's free RAM), a preset such as
            ``"t4"``, or a capacity in bytes.
        load, double_quant, max_new_tokens, batch_size, prompt_tokens: starting values (from the
            notebook's parameters cell, which decides when there is no widget front end).
        **plan_fields: any other :class:`LoadPlan` field (``adapter``, ``device_map``, ...).

    ``panel.plan`` is the current plan; ``panel.set(load="int8")`` changes values from code;
    ``panel.load()`` loads it (or returns what the Load button already loaded for that plan).
    """

    TITLE = "oomkit load panel"
    CONTROLS = (
        Control("load", "Load mode", "dropdown", tuple(LOAD_MODES)),
        Control("double_quant", "Double quant", "checkbox"),
        Control("max_new_tokens", "max_new_tokens", "slider", MAX_NEW_TOKENS_RANGE),
        Control("batch_size", "Batch size", "slider", BATCH_RANGE),
        Control("prompt_tokens", "Prompt tokens", "slider", PROMPT_TOKENS_RANGE),
    )

    def __init__(
        self,
        model: str,
        device: Any = "current",
        *,
        load: str = "nf4",
        double_quant: bool = True,
        max_new_tokens: int = 256,
        batch_size: int = 1,
        prompt_tokens: int = 512,
        widgets: bool | None = None,
        **plan_fields,
    ):
        values = {
            "load": load,
            "double_quant": double_quant,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "prompt_tokens": prompt_tokens,
        }
        self._base = LoadPlan(str(model), **values, **plan_fields)
        self.loaded: tuple | None = None  # (model, tokenizer, report) after Load
        self._loaded_plan: LoadPlan | None = None
        self.error: Exception | None = None
        super().__init__(model, device, values, widgets)

    def plan_for(self, values: dict) -> LoadPlan:
        return self._base.replace(**values)

    def estimate_plan(self, plan: LoadPlan):
        return plan.estimate(self._est_device, model=self._config)

    def disabled(self) -> set[str]:
        return set() if self._values["load"] in FOUR_BIT else {"double_quant"}

    def cache_key(self) -> tuple:
        v = self._values
        dq = v["double_quant"] if v["load"] in FOUR_BIT else None
        return (v["load"], dq, v["max_new_tokens"], v["batch_size"], v["prompt_tokens"])

    def extra_widgets(self, w) -> list:
        button = w.Button(
            description="Load",
            button_style="primary",
            icon="download",
            tooltip="load(panel.plan) and show the LoadReport",
        )
        output = w.Output()
        button.add_class("oomkit-load")
        output.add_class("oomkit-report")
        button.on_click(lambda _: self._on_load())
        self._load_widgets = {"button": button, "output": output}
        return [button, output]

    def _build(self) -> dict[str, Any]:
        c = super()._build()
        c.update(self._load_widgets)
        return c

    def _on_load(self) -> None:
        out, button = self.controls["output"], self.controls["button"]
        button.disabled = True
        out.clear_output()
        from IPython.display import display

        with out:
            print(f"loading {self.plan} ...")
            try:
                _, _, report = self.load()
                out.clear_output()
                display(report)
            except LoadError as e:
                out.clear_output()
                print(f"Not loaded: {e}")
            except Exception as e:  # keep the panel usable; the message says what happened
                out.clear_output()
                kind = "out of memory" if is_oom(e) else type(e).__name__
                print(f"Not loaded ({kind}): {str(e).splitlines()[0][:400] if str(e) else ''}")
            finally:
                button.disabled = False

    # -- loading -------------------------------------------------------------------------------

    def load(self, **load_kwargs):
        """``load(panel.plan)``. The generation budget (``max_new_tokens``, batch, prompt length) needs no
        reload: the loaded model is kept. A new load mode frees the loaded model first, so two models are
        never on the card at once (which would only fit by a slow CPU offload)."""
        plan = self.plan
        if self.loaded is not None and _weights_key(self._loaded_plan) == _weights_key(plan):
            self._loaded_plan = plan
            return self.loaded
        if self.loaded is not None:
            previous, self.loaded, self._loaded_plan = self.loaded[0], None, None
            unload(previous)  # its weights go even where the notebook's `model` name still points at it
        self.error = None
        try:
            self.loaded = load(plan, **load_kwargs)
        except Exception as e:
            self.error = e
            raise
        self._loaded_plan = plan
        return self.loaded

    def release(self) -> None:
        """Forget the loaded model and tokenizer (so ``unload(model)`` can free them)."""
        self.loaded = self._loaded_plan = None

    @property
    def report(self):
        return None if self.loaded is None else self.loaded[2]
