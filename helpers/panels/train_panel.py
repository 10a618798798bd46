"""The training panel: choose QLoRA's load mode, rank, sequence length, micro-batch and memory reducers.

``TrainPanel(plan)`` shows the controls of a :class:`~helpers.TrainPlan` that decide the
memory of a training step; every change re-estimates that step on the target device (a T4 by
default) and states the verdict, the top fix and the time (a step, the run), as :class:`~helpers.LoadPanel` does for
inference. ``panel.plan`` is the plan the following cells load, prepare and train with. A
micro-batch chosen here is the most :func:`~helpers.find_micro_batch` tries: it measures
that a real step fits and takes a smaller divisor of the effective batch when it does not; "auto"
leaves the choice to the measurement. The memory reducers (``loss``: plain, chunked or fused
cross-entropy; ``offload_activations``) are controls too: an option this machine cannot run (fused
without liger-kernel) is labelled "(not here)" and a note under the verdict says why.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.devices import resolve_device
from ..core.reducers import loss_available, loss_choices
from ..core.vocab import FOUR_BIT, LOAD_MODES, half_dtype
from ..estimator.timing import view_time
from ..training.plan import TrainPlan
from .state import ReducerTable, host_note, train_time_text
from .widgets import Control, Panel

__all__ = ["TrainPanel"]

TRAIN_SEGMENTS = (  # (label, estimate row groups, opacity) in bar order
    ("weights", ("weights",), 1.0),
    ("training state", ("training",), 0.7),
    ("activations", ("activations",), 0.5),
    ("overheads", ("overhead",), 0.3),
)
RANK_RANGE = (4, 128, 4)
SEQ_LEN_RANGE = (64, 4096, 64)


def divisors(n: int) -> tuple[int, ...]:
    """The micro-batches that keep an effective batch of ``n`` exact with gradient accumulation."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


# The micro-batch dropdown's "let find_micro_batch measure it" choice. Not None: ipywidgets reads a None
# value as "nothing selected" and showed the dropdown blank.
AUTO = "auto"


class TrainPanel(Panel):
    """Widgets over a :class:`TrainPlan`: load mode, double quant, gradient checkpointing, LoRA rank,
    sequence length, micro-batch, loss and activation offload, with the training-step estimate
    against ``device``.

    Args:
        plan: the starting plan (the notebook's parameters); every other field is kept as is.
        device: a preset such as ``"t4"`` (what to plan for), ``"current"`` or a capacity in bytes.
        widgets: force widgets on or off (default: on inside a notebook kernel with ipywidgets).

    The micro-batch starts at the plan's; "auto (measure)" (``None``, the default without one) lets
    :func:`~helpers.find_micro_batch` decide, as without a panel, and the estimate counts
    micro-batch 1 meanwhile.
    """

    TITLE = "oomkit training panel"
    SEGMENTS = TRAIN_SEGMENTS

    def __init__(self, plan: TrainPlan, device: Any = "t4", *, widgets: bool | None = None):
        if not isinstance(plan, TrainPlan):
            raise TypeError(
                f"TrainPanel takes a TrainPlan, got {type(plan).__name__} {plan!r:.60}: "
                "e.g. TrainPanel(TrainPlan('codellama/CodeLlama-7b-hf', seq_len=256), device='t4')"
            )
        self._base = plan
        self.CONTROLS = (
            Control("load", "Load mode", "dropdown", tuple(LOAD_MODES)),
            Control("double_quant", "Double quant", "checkbox"),
            Control("gradient_checkpointing", "Gradient checkpointing", "checkbox"),
            Control("r", "LoRA rank", "slider", RANK_RANGE),
            Control("seq_len", "Sequence length", "slider", SEQ_LEN_RANGE),
            Control(
                "micro_batch",
                "Micro-batch",
                "dropdown",
                (("auto (measure)", AUTO), *((str(d), d) for d in divisors(plan.batch_size))),
            ),
            Control("loss", "Loss", "dropdown", loss_choices()),
            Control("offload_activations", "Offload activations", "checkbox"),
        )
        values = {
            "load": plan.load,
            "double_quant": plan.double_quant,
            "gradient_checkpointing": plan.gradient_checkpointing,
            "r": plan.r,
            "seq_len": plan.seq_len,
            "micro_batch": AUTO if plan.micro_batch is None else plan.micro_batch,
            "loss": plan.loss,
            "offload_activations": plan.offload_activations,
        }
        super().__init__(plan.model, device, values, widgets)

    def plan_for(self, values: dict) -> TrainPlan:
        micro = values["micro_batch"]
        return self._base.replace(**{**values, "micro_batch": None if micro in (AUTO, None) else micro})

    def set(self, **values):
        """As :meth:`Panel.set`; ``micro_batch=None`` is the "auto (measure)" choice."""
        if "micro_batch" in values and values["micro_batch"] is None:
            values["micro_batch"] = AUTO
        return super().set(**values)

    def estimate_plan(self, plan: TrainPlan):
        return plan.estimate(self.estimate_device, model=self.config)

    def disabled(self) -> set[str]:
        return set() if self.values["load"] in FOUR_BIT else {"double_quant"}

    def time_for(self, plan: TrainPlan, est) -> tuple[Any, str]:
        """One optimizer step (the micro-batch's step x accumulation) and the plan's ``max_steps``, from the one
        time answer (:func:`~helpers.estimator.timing.view_time`)."""
        micro = plan.micro_batch or 1
        accumulation = max(1, plan.batch_size // micro)
        t = view_time(est, batches=(1,), steps=plan.max_steps * accumulation, cached=os.path.isdir(self.model))
        return t, train_time_text(t, plan.max_steps, accumulation)

    def cache_key(self) -> tuple:
        v = self.values
        if v["load"] not in FOUR_BIT:
            v["double_quant"] = None
        return tuple(v[c.key] for c in self.CONTROLS)

    def reducers(self) -> ReducerTable:
        """The current plan's step estimate with each loss and with activation offload, on the panel's device."""
        plan = self.plan
        settings = (
            ("loss=plain", {"loss": "plain", "offload_activations": False}),
            ("loss=chunked", {"loss": "chunked", "offload_activations": False}),
            ("loss=fused", {"loss": "fused", "offload_activations": False}),
            ("offload_activations=True", {"loss": "plain", "offload_activations": True}),
            ("loss=chunked + offload_activations=True", {"loss": "chunked", "offload_activations": True}),
        )
        rows = [
            (change, self.estimate_plan(plan.replace(**kw)), loss_available(kw["loss"])[1]) for change, kw in settings
        ]
        title = (
            f"{self.model}: {plan.load}, seq {plan.seq_len}, micro-batch {plan.micro_batch or 1}, checkpointing "
            f"{'on' if plan.gradient_checkpointing else 'off'}, on {self.device_label}"
        )
        return ReducerTable(title, self.state.capacity, rows)

    def notes(self) -> list[str]:
        """Why a chosen reducer cannot run here, and how the estimate's device trains otherwise than this runtime."""
        ok, why = loss_available(self.values["loss"])
        return ([] if ok else [why]) + host_note(self.state.estimate) + self._device_notes()

    def _device_notes(self) -> list[str]:
        """Say so when the estimate's device trains otherwise than this runtime (the plan's text shows this one's)."""
        _, dev = resolve_device(self.estimate_device)
        if dev is None:
            return []
        plan = self.plan
        optimizer = plan.lora_training(gpu=True).optimizer
        precision = plan.precision if plan.precision != "auto" else half_dtype(bool(dev.get("bf16")))
        here = (plan.resolved_optimizer(), plan.resolved_precision())
        if here == (optimizer, precision):
            return []
        return [
            f"estimated as it trains on {self.device_label}: {optimizer}, {precision}; this runtime would "
            f"train with {here[0]}, {here[1]}"
        ]
