"""The load panel: choose load mode, ``max_new_tokens`` and batch with widgets, see the fit at once, load.

``LoadPanel(model)`` shows a dropdown, a checkbox and sliders; every change re-estimates memory
(cached: the model's layout is counted once on the meta device, and each setting combination is
computed once), redraws a bar of the breakdown against the device, states the fit verdict and the
top fix, and ``panel.plan`` is always the matching :class:`~helpers.LoadPlan`. Without a
widget front end (papermill, plain Python, no ipywidgets) the panel is a printed summary and the
notebook's parameters decide.

Over several GPUs (``device="kaggle-2xt4"``, ``["t4", "t4"]``, or ``"current"`` where torch sees more
than one) the panel places the plan as :func:`~helpers.load` does there, one bar per GPU: on
GPU 0 alone when it fits (the others drawn free), else split, as
:func:`~helpers.decide_placement` decides (once per setting; a "GPUs" dropdown sets
``LoadPlan.gpus``), the layer runs in the verdict, and a top fix checked by placing it the same way.
On one GPU that is half of a multi-GPU set (``"t4"``: ``"kaggle-2xt4"``), a plan that does not fit
says whether the set would hold it.

DOM hooks for browser tests: every control has a stable ``description`` ("Load mode", "Double
quant", "max_new_tokens", "Batch size", "Prompt tokens", "KV cache", "GPUs" over several, button "Load") and CSS
classes ``oomkit-panel``, ``oomkit-estimate`` (the bar), ``oomkit-verdict`` (verdict + fix text, with
``data-verdict``), ``oomkit-time`` (the plan's time: load, tokens/s, the answers' total), ``oomkit-notes`` (``oomkit-panel-note`` lines: why a chosen option cannot run here),
``oomkit-load`` (button) and ``oomkit-report`` (output after loading). A KV cache kind this machine cannot
run (int4 without optimum-quanto or hqq) is labelled "(not here)" in its dropdown. Over several
GPUs the estimate holds ``oomkit-gpu-bar`` (``data-gpu``) per GPU and ``oomkit-left-over`` lines, the
verdict ``data-gpus`` and ``oomkit-note``; a single GPU's hint is ``oomkit-alternative``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from html import escape
from typing import Any

from ..core.devices import DEVICE_SETS, resolve_device
from ..core.errors import LoadError, OomkitError
from ..core.knobs import KNOBS, register_control
from ..core.memory import ram_readout
from ..core.reducers import kv_cache_available, kv_cache_choices, use_kv_cache
from ..core.session import enable_colab_widgets
from ..core.units import GiB, format_bytes
from ..core.vocab import DEFAULTS, DOES_NOT_FIT, FOUR_BIT, KV_CACHES, LOAD_MODES
from ..estimator.configs import resolve_config
from ..estimator.core import MemoryEstimate
from ..estimator.fitting import fit_one_card
from ..estimator.timing import view_time
from ..loading.loader import load
from ..loading.plan import LoadPlan
from ..oom.messages import is_oom
from ..oom.reclaim import clear_exception_frames, unload
from ..placement.decision import SPLIT, PlacementDecision, decide_placement, devices_snapshot
from ..placement.device_plan import DevicePlan, bnb_prequantized, one_move
from .gpus import (
    Alternative,
    FirstGpuState,
    SplitFix,
    SplitState,
    gpu_specs,
    hashable_devices,
    multi_gpu_set,
    split_gpus,
    split_target,
)
from .state import SEGMENTS, PanelState, ReducerTable, host_note, judgement, load_time_text, notes_html

__all__ = [
    "Control",
    "LoadPanel",
    "Panel",
    "widget_bundle",
    "widgets_available",
]  # fmt: skip

# the plan fields plan_devices takes: a fix changing anything else (another model) is not tried on the split
SPLIT_KNOBS = frozenset({"load", "double_quant", "max_new_tokens", "batch_size", "prompt_tokens"})
NOT_SPLIT = "the split across GPUs is planned with the default dynamic KV cache"
MAX_FIX_TRIES = 4  # candidate fixes planned across the GPUs (~5 ms each, ~0.1 s for a new load mode)
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
    """The plan without its generation budget and KV cache: what decides the loaded weights."""
    return dataclasses.replace(plan, max_new_tokens=0, batch_size=1, prompt_tokens=1, kv_cache="dynamic")


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
        if not isinstance(model, str | os.PathLike):  # the Load button needs something from_pretrained reads
            raise TypeError(
                f"a panel takes a hub id or a model folder, got {type(model).__name__}: for a config, save it "
                "first (config.save_pretrained('my_model')) and pass 'my_model'; estimate() takes the config itself"
            )
        self.model = str(model)
        self.device = device
        self._config = resolve_config(self.model)[0]
        self._capacity, self._device_label, self._est_device = self.target(device)
        self._cache: dict[tuple, PanelState] = {}
        self._values = dict(values)
        self._quiet = False
        self.plan_for(self._values)  # a bad starting value fails here, before any widget exists
        use = widgets_available() if widgets is None else widgets
        self.controls: dict[str, Any] | None = self._build() if use and _ipywidgets() is not None else None
        for control in self.CONTROLS if self.controls is not None else ():
            if control.key in KNOBS:  # an OOM's fixes name the control that sets the knob
                register_control(control.key, f"the {self.TITLE}'s {control.description} {control.kind}")
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

    def target(self, device: Any) -> tuple[int, str, Any]:
        """(capacity bytes, label, device argument for the estimator) of the panel's ``device``."""
        return _resolve_panel_device(device)

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

    def time_for(self, plan, est: MemoryEstimate) -> tuple[Any, str]:
        """(the plan's :class:`~helpers.estimator.timing.TimeEstimate` or None, the panel's time line)."""
        return None, ""

    # -- widgets ----------------------------------------------------------------------------------

    def _control_widget(self, w, control: Control):
        style = {"description_width": "initial"}
        value = self._values[control.key]
        # ipywidgets 7.7 (Colab) draws a dropdown and a checkbox 300 px wide each: side by side they widened
        # the whole output past a narrow column (Files pane open), cutting off every slider value and line
        if control.kind == "dropdown":
            return w.Dropdown(
                options=list(control.choices), value=value, description=control.description, style=style,
                layout=w.Layout(max_width="100%"),
            )  # fmt: skip
        if control.kind == "checkbox":
            return w.Checkbox(value=value, description=control.description, indent=False, layout=w.Layout(width="auto"))
        lo, hi, step = control.choices
        # as wide as the output allows up to 480 px: a fixed 480 px pushed the value readout past the
        # right edge of a 760 px window (Colab's narrow column), where nobody could read it
        return w.IntSlider(
            value=value, min=min(lo, value), max=max(hi, value), step=step, description=control.description,
            continuous_update=True, style=style, layout=w.Layout(width="100%", max_width="480px"),
        )  # fmt: skip

    def _build(self) -> dict[str, Any]:
        w = _ipywidgets()
        enable_colab_widgets()  # done at import already; again in case helpers.panels.widgets came first
        c = {control.key: self._control_widget(w, control) for control in self.CONTROLS}
        for widget in c.values():
            widget.observe(self._on_change, names="value")
        c["estimate"], c["verdict"], c["time"], c["notes"] = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        c["estimate"].add_class("oomkit-estimate")
        c["verdict"].add_class("oomkit-verdict")
        c["time"].add_class("oomkit-time")
        c["notes"].add_class("oomkit-notes")
        rows, pending = [], []  # a checkbox sits beside the dropdown before it
        for control in self.CONTROLS:
            if control.kind == "checkbox" and pending:
                pending.append(c[control.key])
                continue
            if pending:
                rows.append(self._row(w, pending))
            pending = [c[control.key]]
        if pending:
            rows.append(self._row(w, pending))
        title = w.HTML(f"<b>{escape(self.TITLE)}</b>: {escape(self.model)}")
        extra = self.extra_widgets(w)
        c["box"] = w.VBox([title, *rows, c["estimate"], c["verdict"], c["time"], c["notes"], *extra])
        c["box"].add_class("oomkit-panel")
        return c

    @staticmethod
    def _row(w, widgets: list):
        """One widget, or several side by side that wrap onto the next line where the column is narrow."""
        return w.HBox(widgets, layout=w.Layout(flex_flow="row wrap")) if len(widgets) > 1 else widgets[0]

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
        with one_move():  # the decision, its fix and the fixes tried ask some placements twice: once each
            est = self.estimate_plan(plan)
            state = self.judge(plan, est)
            state.time, state.time_text = self.time_for(plan, est)
        state.seconds = time.perf_counter() - started
        if use_cache and key is not None:
            self._cache[key] = state
        return state

    def judge(self, plan: Any, est: MemoryEstimate) -> PanelState:
        """The verdict of ``est`` against the panel's device, with the top fix when it does not fit."""
        target = self._capacity if self._est_device == "cpu" else self._est_device
        result, suggestion = judgement(est, self._capacity, target)
        return PanelState(
            plan, est, result, self._capacity, self._device_label, suggestion, segments_spec=self.SEGMENTS
        )

    def refresh(self) -> PanelState:
        """Recompute (or fetch) the state for the current values and redraw the widgets."""
        started = time.perf_counter()
        cached = self.cache_key() in self._cache
        state = self.compute()
        self.state = state  # before the notes, which may look at it
        if self.controls is not None:
            c = self.controls
            off = self.disabled()
            for control in self.CONTROLS:
                c[control.key].disabled = control.key in off
            c["estimate"].value = state.bar_html()
            c["verdict"].value = state.verdict_html()
            c["time"].value = state.time_html()
            c["notes"].value = notes_html(self.notes())
        state.cached = cached
        state.seconds = time.perf_counter() - started
        return state

    # -- display ----------------------------------------------------------------------------------

    def summary(self) -> str:
        s = self.state
        lines = [f"{self.TITLE}: {self.model}", f"  plan: {self.plan}", *(f"  {line}" for line in s.text_lines())]
        lines += [f"  note: {m}" for m in [*s.estimate.warnings, *s.notes(), *self.notes()]]
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
            f"{escape(str(self.plan))}</div>"
            + self.state.bar_html()
            + self.state.verdict_html()
            + self.state.time_html()
            + notes_html(self.notes())
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


SPILL_DEFAULT = "transformers' placement for it"


@dataclass
class PlacementSpill:
    """The estimate fits one card, but transformers' placement would offload ``spill`` bytes to the CPU."""

    spill: int
    fix: str
    can_offload: bool = True  # False for a checkpoint saved quantized by bitsandbytes: it cannot be offloaded
    why: str = SPILL_DEFAULT  # the decision's spill_why (bitsandbytes' margin only for int8/4-bit)

    def __str__(self) -> str:
        offload = ", or allow_offload=True (every token slower)" if self.can_offload else ""
        return (
            f"The estimate fits, but {self.why} leaves {format_bytes(self.spill)}+ of weights for CPU RAM: "
            f"load() refuses it. Fix: {self.fix}{offload}"
        )


class LoadPanel(Panel):
    """Widgets that build a :class:`LoadPlan`, show whether it fits, and load it with one click.

    Args:
        model: hub id, shipped config name or local directory (only its config is read here).
        device: ``"current"`` (this GPU; without one, this machine's free RAM; with several, all of
            them), a preset such as ``"t4"``, or a capacity in bytes; or several GPUs: a set such as
            ``"kaggle-2xt4"``, a list such as ``["t4", "t4"]`` or ``{0: bytes, 1: bytes}``. Over several
            GPUs the panel shows one bar per GPU, placing the plan as ``load()`` does on such a machine:
            GPU 0 alone when it fits there, else the ``device_map="auto"`` split (``gpus`` is a control).
        load, double_quant, max_new_tokens, batch_size, prompt_tokens, kv_cache: starting values (from
            the notebook's parameters cell, which decides when there is no widget front end).
        **plan_fields: any other :class:`LoadPlan` field (``adapter``, ``device_map``, ...).

    ``panel.plan`` is the current plan; ``panel.set(load="int8")`` changes values from code;
    ``panel.load()`` loads it (or returns what the Load button already loaded for that plan);
    ``panel.placement`` is the split over several GPUs (a :class:`~helpers.DevicePlan`; None
    while the plan stays on GPU 0 alone).
    On one GPU that is a preset of a multi-GPU set (``"t4"``: ``"kaggle-2xt4"``), a plan that does
    not fit says whether it would fit split across that set.
    """

    TITLE = "oomkit load panel"
    CONTROLS = (
        Control("load", "Load mode", "dropdown", tuple(LOAD_MODES)),
        Control("double_quant", "Double quant", "checkbox"),
        Control("max_new_tokens", "max_new_tokens", "slider", MAX_NEW_TOKENS_RANGE),
        Control("batch_size", "Batch size", "slider", BATCH_RANGE),
        Control("prompt_tokens", "Prompt tokens", "slider", PROMPT_TOKENS_RANGE),
        Control("kv_cache", "KV cache", "dropdown", KV_CACHES),
    )

    def __init__(
        self,
        model: str,
        device: Any = "current",
        *,
        load: str = "nf4",
        double_quant: bool = True,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        batch_size: int = DEFAULTS.batch_size,
        prompt_tokens: int = DEFAULTS.prompt_tokens,
        kv_cache: str = "dynamic",
        widgets: bool | None = None,
        **plan_fields,
    ):
        values = {
            "load": load,
            "double_quant": double_quant,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "prompt_tokens": prompt_tokens,
            "kv_cache": kv_cache,
        }
        self._base = LoadPlan(str(model), **values, **plan_fields)
        self.loaded: tuple | None = None  # (model, tokenizer, report) after Load
        self._loaded_plan: LoadPlan | None = None
        self.error: Exception | None = None
        self._gpus = split_gpus(device)
        self._pair = None if self._gpus is not None else multi_gpu_set(device)
        self._decisions: dict[tuple, PlacementDecision] = {}
        self._lightest: int | None = None  # the model's weights in 4-bit (_least_weights)
        self.CONTROLS = tuple(  # each KV cache kind labelled with whether it runs here
            Control(c.key, c.description, c.kind, kv_cache_choices()) if c.key == "kv_cache" else c
            for c in type(self).CONTROLS
        )
        if self._gpus is not None:  # how many of them load() may use: a control of its own
            self._specs = gpu_specs(device, self._gpus)
            values["gpus"] = self._base.gpus
            self._base = self._base.replace(gpus=None)
            choices = (("auto", None), *((str(n), n) for n in range(1, len(self._gpus) + 1)))
            self.CONTROLS = (*self.CONTROLS, Control("gpus", "GPUs", "dropdown", choices))
        super().__init__(model, device, values, widgets)

    def target(self, device: Any) -> tuple[int, str, Any]:
        return super().target(device) if self._gpus is None else split_target(device, self._gpus)

    def plan_for(self, values: dict) -> LoadPlan:
        n = values.get("gpus")
        if self._gpus is not None and n is not None and n > len(self._gpus):
            raise ValueError(f"gpus={n}: the panel's device has {len(self._gpus)} GPUs (None: as many as needed)")
        return self._base.replace(**values)

    def estimate_plan(self, plan: LoadPlan):
        return plan.estimate(self._est_device, model=self._config)

    def disabled(self) -> set[str]:
        return set() if self._values["load"] in FOUR_BIT else {"double_quant"}

    def time_for(self, plan: LoadPlan, est: MemoryEstimate) -> tuple[Any, str]:
        """Load time, decode tokens/s and the answers' total at the plan's batch, from the one time answer
        (:func:`~helpers.estimator.timing.view_time`: the preset's card, or this machine's calibration)."""
        t = view_time(est, batches=(plan.batch_size,), cached=os.path.isdir(self.model))
        return t, load_time_text(t, plan.batch_size)

    def notes(self) -> list[str]:
        """Why the chosen KV cache cannot run here (its backend, or no CUDA GPU), and that a split ignores it."""
        kind = self._values["kv_cache"]
        ok, why = kv_cache_available(kind, cuda=self.estimate_device != "cpu")
        notes = ([] if ok else [why]) + host_note(self.state.estimate)
        if kind != "dynamic" and isinstance(self.state, SplitState):
            notes.append(NOT_SPLIT)
        return notes

    def reducers(self) -> ReducerTable:
        """The current plan's estimate with each KV cache kind, on the panel's device (the first GPU of several)."""
        plan = self.plan
        cuda = self.estimate_device != "cpu"
        rows = [
            (f"kv_cache={k}", self.estimate_plan(plan.replace(kv_cache=k)), kv_cache_available(k, cuda=cuda)[1])
            for k in KV_CACHES
        ]
        title = (
            f"{self.model}: {plan.load}, batch {plan.batch_size} x ({plan.prompt_tokens} prompt + "
            f"{plan.max_new_tokens} new tokens), on {self.device_label}"
        )
        return ReducerTable(title, self.state.capacity, rows)

    # -- several GPUs ----------------------------------------------------------------------------

    @property
    def placement(self) -> DevicePlan | None:
        """The current plan's split across the panel's GPUs (None on one device, or on GPU 0 alone)."""
        return self.state.placement if isinstance(self.state, SplitState) else None

    def decision_for(self, plan: LoadPlan, est: MemoryEstimate, devices: Any = None) -> PlacementDecision:
        """:func:`~helpers.decide_placement` of ``plan`` on ``devices`` (default: the panel's
        GPUs; no RAM to offload to), once per setting: the first plan of a load mode builds the model on the
        meta device (~0.1-2 s), a repeat ~5 ms."""
        devices = self._specs if devices is None else devices
        dq = plan.double_quant if plan.load in FOUR_BIT else None
        key = (hashable_devices(devices), plan.load, dq, plan.compute_dtype, plan.max_new_tokens, plan.batch_size,
               plan.prompt_tokens, plan.gpus, plan.kv_cache)  # fmt: skip
        if key not in self._decisions:
            specs = [resolve_device(d) for d in devices]
            gpus = [{"name": label, "capacity": d["capacity"], "bf16": d["bf16"]} for label, d in specs]
            # where it goes: the panel's fix is its own (fit()'s top fix, or _split_fix), so no refusal's fix
            self._decisions[key] = decide_placement(plan, est, devices_snapshot(est, gpus), fixes=False)
        return self._decisions[key]

    def arrangement(self, plan: LoadPlan, est: MemoryEstimate) -> tuple[str, DevicePlan | None]:
        """(verdict, split) of ``plan`` on the panel's GPUs, as :meth:`decision_for` places it: on GPU 0 alone
        (split None), or split across ``plan.gpus`` GPUs (default all)."""
        decided = self.decision_for(plan, est)
        if decided.gpus < 2 or decided.plan is None:
            return (DOES_NOT_FIT if decided.spill else decided.first_verdict), None
        return decided.verdict, decided.plan

    def judge(self, plan: LoadPlan, est: MemoryEstimate) -> PanelState:
        """One device: as :class:`Panel` (and, when it does not fit, whether the GPU's multi-GPU set would hold
        it). Several: where ``load()`` would put it (:meth:`decision_for`), and the top fix when it does not fit."""
        if self._gpus is None:
            state = super().judge(plan, est)
            # a device under 2 GiB is a test double (the tiny model's rehearsals): the placement's fixed 256 MiB
            # margin would decide there, not the plan
            if state.verdict != DOES_NOT_FIT and self._est_device != "cpu" and self._capacity >= 2 * GiB:
                self._mark_spill(state, self.decision_for(plan, est, [self.device]))
            if state.verdict == DOES_NOT_FIT and self._pair is not None and state.alternative is None:
                state.alternative = self._alternative(plan, est, self._pair, f"device={self._pair!r}")
            return state
        decided = self.decision_for(plan, est)
        if decided.gpus < 2 or decided.plan is None:
            return self._first_gpu_state(plan, est, decided)
        fix = self._split_fix(plan, est, decided.plan) if decided.refused else None
        return SplitState(
            plan, est, decided.verdict, self._capacity, self.device_label, segments_spec=self.SEGMENTS,
            placement=decided.plan, fix=fix,
        )  # fmt: skip

    @staticmethod
    def _mark_spill(state: PanelState, decided: PlacementDecision) -> None:
        """The decision's answer where the estimate fits the card but transformers' placement for it leaves
        weights for the CPU: ``load()`` refuses, and so does the panel, saying why."""
        if decided.spill and decided.gpus < 2:
            est = state.estimate
            state.verdict = DOES_NOT_FIT
            state.alternative = PlacementSpill(decided.spill, decided.fix, not bnb_prequantized(est), decided.why)

    def _first_gpu_state(self, plan: LoadPlan, est: MemoryEstimate, decided: PlacementDecision) -> FirstGpuState:
        label0, gpu0 = self._gpus[0]
        result, suggestion = judgement(est, gpu0["capacity"], self._est_device)
        state = FirstGpuState(
            plan, est, result, gpu0["capacity"], self.device_label, suggestion, segments_spec=self.SEGMENTS,
            gpu0=label0, free=[(label, d["capacity"]) for label, d in self._gpus[1:]],
        )  # fmt: skip
        if result != DOES_NOT_FIT:
            self._mark_spill(state, decided)  # gpus=1 on a plan transformers would half-offload
        if state.verdict == DOES_NOT_FIT and state.alternative is None and len(self._gpus) > 1:
            # gpus=1 was asked for: would all the GPUs hold it?
            state.alternative = self._alternative(plan, est, self._specs, f"gpus={len(self._gpus)}")
        return state

    def _split_fix(self, plan: LoadPlan, est: MemoryEstimate, split: DevicePlan) -> SplitFix | None:
        """The first of the estimator's fixes (against the GPUs' memory added up, least drastic first) that
        places as fitting (:meth:`arrangement`); else the split's own advice."""
        together = {"name": "the GPUs' memory added up", "capacity": sum(g.capacity for g in split.gpus),
                    "bf16": all(d["bf16"] for _, d in self._gpus)}  # a T4 has no bf16: no bf16 fix  # fmt: skip
        # a split holds every weight on a card: weights beyond the cards added up fit no split (nothing to plan),
        # and no fix of these knobs weighs less than the model in 4-bit
        hopeless = not plan.allow_offload and self._least_weights(est) > together["capacity"]
        candidates = [] if hopeless else fit_one_card(est, together).suggestions
        for s in [s for s in candidates if set(s.kwargs) <= SPLIT_KNOBS][:MAX_FIX_TRIES]:
            if not plan.allow_offload and s.estimate.weights > together["capacity"]:
                continue
            result, tried = self.arrangement(plan.replace(**s.kwargs), s.estimate)
            if result != DOES_NOT_FIT:
                return SplitFix(s.change, dict(s.kwargs), result, tried)
        return SplitFix(split.fixes[0]) if split.fixes else None

    def _least_weights(self, est: MemoryEstimate) -> int:
        """The fewest bytes of weights any setting of the panel's knobs gives this model: its 4-bit load (0 where
        it has no other load mode, a pre-quantized checkpoint). Once per panel: the other plan fields stay."""
        if self._lightest is None:
            try:
                self._lightest = min(est.replace(load=m, double_quant=True).weights for m in FOUR_BIT)
            except (OomkitError, ValueError):  # a checkpoint that loads only as saved
                self._lightest = 0
        return min(self._lightest, est.weights)

    def _alternative(self, plan: LoadPlan, est: MemoryEstimate, devices: Any, how: str) -> Alternative | None:
        """``plan`` split across ``devices`` (a multi-GPU set, or this panel's GPUs), when it would fit there."""
        specs = DEVICE_SETS[devices] if isinstance(devices, str) else devices
        # a split needs at least the whole-model estimate (each GPU adds its own context): skip hopeless plans
        if est.total > sum(resolve_device(d)[1]["capacity"] for d in specs):
            return None
        decided = self.decision_for(plan.replace(gpus=len(specs)), est, specs)
        return Alternative(how, decided.plan) if decided.where == SPLIT and decided.plan is not None else None

    def cache_key(self) -> tuple:
        v = self._values
        dq = v["double_quant"] if v["load"] in FOUR_BIT else None
        key = (v["load"], dq, v["max_new_tokens"], v["batch_size"], v["prompt_tokens"], v["kv_cache"])
        return key if self._gpus is None else (*key, v["gpus"])

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
                if is_oom(e):  # the card the notebook's OOM handler shows (fixes naming this panel's controls)
                    from ..oom.diagnosis import explain_oom

                    display(explain_oom(e))
                    clear_exception_frames(e)  # the failed load's frames pin what it had placed (self.error stays)
                else:
                    print(f"Not loaded ({type(e).__name__}): {str(e).splitlines()[0][:400] if str(e) else ''}")
            finally:
                button.disabled = False

    # -- loading -------------------------------------------------------------------------------

    def load(self, **load_kwargs):
        """``load(panel.plan)``. The generation budget (``max_new_tokens``, batch, prompt length, KV cache) needs no
        reload: the loaded model is kept. A new load mode frees the loaded model first, so two models are
        never on the card at once (which would only fit by a slow CPU offload)."""
        plan = self.plan
        if self.loaded is not None and _weights_key(self._loaded_plan) == _weights_key(plan):
            use_kv_cache(self.loaded[0], plan.kv_cache)  # another KV cache needs no reload either
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
