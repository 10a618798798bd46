"""Does an estimate fit a device, and if not, which changes would make it fit (each re-estimated)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from html import escape
from typing import Any

from ..core.arguments import flag, whole_number
from ..core.devices import DEFAULT_DEVICE, DEVICE_SETS, capacity_range, device_set, resolve_device, resolve_devices
from ..core.html import Markup, badge, bar, colored, table
from ..core.reducers import kv_cache_available, liger_available
from ..core.sources import shipped_configs
from ..core.units import MiB, format_bytes
from ..core.vocab import (
    BF16,
    DOES_NOT_FIT,
    FITS,
    FOUR_BIT,
    QUANTIZED,
    TIGHT,
    TIGHT_FRACTION,
    VERDICT_STATUS,
    lighter_loads,
    verdict,
)
from .configs import resolve_config
from .core import MemoryEstimate, cublas_workspace, estimate
from .families import family
from .reducers import HOST_RAM, host_cost
from .rows import EstimateError
from .timing import CARDS, approx_duration, estimate_time
from .training import OPTIMIZERS, FullTraining, LoraTraining

__all__ = [
    "target_cards",
    "Suggestion", "DeviceSuggestion", "FitVerdict", "fit_one_card", "format_params", "max_new_tokens_that_fit", "max_batch_that_fits",
    "fix_margin", "step_seconds", "rate_text", "rank_fixes", "past_context",
]  # fmt: skip

# A fix ranks as one that fits only with this much to spare below the "tight" line: 2 % of the
# capacity, at most 256 MiB (a prompt cut to 256 tokens that fits a T4 with 7 MiB to spare is no
# better than the estimate's own error). A fix that fits with less ranks after those that have it.
FIX_MARGIN_SHARE = 0.02
FIX_MARGIN_MAX = 256 * MiB


def fix_margin(capacity: int) -> int:
    """Bytes a fix must leave below ``TIGHT_FRACTION`` of ``capacity`` to rank as one that fits."""
    return min(int(capacity * FIX_MARGIN_SHARE), FIX_MARGIN_MAX)


def _comfortable(capacity: int) -> int:
    return int(capacity * TIGHT_FRACTION) - fix_margin(capacity)


@dataclass
class Suggestion:
    """A change that lowers memory (one setting, or a few joined by " + " when no single one fits),
    with its saving computed by re-estimating."""

    change: str
    kwargs: dict
    saving: int
    estimate: MemoryEstimate
    cost: str = ""  # what a memory reducer costs besides memory: host RAM, time per step or token
    seconds: float | None = None  # per decode step (or LoRA step) once made: step_seconds(), offload's PCIe added
    placed: str | None = None  # the placement's verdict where it overrules the estimate's (it would spill to the CPU)

    @property
    def total(self) -> int:
        """What the fix leaves on the card (for a split or an offload: on the fullest card)."""
        return self.estimate.total

    def verdict_on(self, capacity: int) -> str:
        """ "fits", "tight" or "does not fit" once the fix is made, on a card of ``capacity`` bytes."""
        return self.placed or verdict(self.total, capacity)

    @property
    def detail(self) -> str:
        """The change, and for a fix that places the model elsewhere, where everything goes and what it costs."""
        return self.change

    def __str__(self) -> str:
        cost = f"; costs {self.cost}" if self.cost else ""
        return f"{self.change}: saves {format_bytes(self.saving)} (total {format_bytes(self.estimate.total)}{cost})"


@dataclass
class DeviceSuggestion(Suggestion):
    """A fix that keeps every setting and places the model past one card: split over several GPUs
    (``kind="split"``) or with some decoder layers in CPU RAM (``kind="offload"``), as
    :func:`helpers.plan_devices` places it (``plan``, its :class:`helpers.DevicePlan`; ``where``
    its split in words). ``kwargs`` are :class:`helpers.LoadPlan` fields, not ``estimate()`` ones;
    ``saving`` and :attr:`total` are the fullest GPU's share."""

    kind: str = "split"
    where: str = ""
    plan: Any = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return max((s.total for s in self.plan.gpus), default=0)

    def verdict_on(self, capacity: int) -> str:
        # the placement decided it: each card's share already keeps room for its KV cache, activations,
        # context and a margin, so an offload that fills a card to 90 % is not "tight" the way an estimate is
        return FITS if self.plan.fits else DOES_NOT_FIT

    @property
    def detail(self) -> str:
        return f"{self.change}: {self.where}" + (f"; costs {self.cost}" if self.cost else "")

    def __str__(self) -> str:
        cost = f"; costs {self.cost}" if self.cost else ""
        return f"{self.change}: {self.where} (saves {format_bytes(self.saving)} on the fullest card{cost})"


@dataclass
class FitVerdict:
    """Whether an estimate fits a device: "fits", "tight" or "does not fit", and what to change."""

    verdict: str
    headroom: int
    capacity: int
    device: str
    estimate: MemoryEstimate
    suggestions: list[Suggestion] = field(default_factory=list)
    note: str = ""  # why the verdict is less sure than its headroom says (a capacity that varies)
    where: str = ""  # on a machine of several GPUs that load() splits the model over: the split, in words
    used: int | None = None  # then: the bytes on its fullest card (the verdict's); None: the whole estimate, one card
    seconds: float | None = None  # per decode step (or LoRA step) on the device: step_seconds(); None: not timed

    @property
    def fits(self) -> bool:
        return self.verdict != DOES_NOT_FIT

    @property
    def placed_bytes(self) -> int:
        """What the verdict weighs against ``capacity``: the estimate, or its fullest card's share when split."""
        return self.estimate.total if self.used is None else self.used

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "headroom": self.headroom, "capacity": self.capacity, "device": self.device,
                "seconds": self.seconds,
                "suggestions": [{"change": s.change, "kwargs": _jsonable(s.kwargs), "saving": s.saving,
                                 "total": s.total, "cost": s.cost, "seconds": s.seconds, **_placed(s)}
                                for s in self.suggestions],
                **({"note": self.note} if self.note else {}),
                **({"where": self.where, "used": self.used} if self.where else {})}  # fmt: skip

    @property
    def time(self) -> str:
        """The plan's speed on the device, from :func:`step_seconds` ("" where it cannot be timed)."""
        if self.seconds is None:
            return ""
        return f"{rate_text(self.estimate, self.seconds)} on {self.device} (datasheet x efficiency; estimate_time())"

    def fix_time(self, s: Suggestion) -> str:
        """A fix's speed once made, and how it compares with the plan's: ``~4.1 tokens/s, 3.6x slower``."""
        if s.seconds is None:
            return ""
        before = None if self.seconds is None else _per_sequence(self.estimate, self.seconds)
        return rate_text(s.estimate, s.seconds) + _relative(_per_sequence(s.estimate, s.seconds), before)

    def lines(self, time: bool = True) -> list[str]:
        """The verdict's lines as ``str()`` prints them (``time=False``: without the plan's own speed, for a
        caller that printed the estimate's time line already)."""
        on = f"the fullest GPU of {self.device}" if self.where else self.device
        head = (
            f"{self.verdict.upper()}: {format_bytes(self.placed_bytes)} of {format_bytes(self.capacity)} on "
            f"{on} (headroom {format_bytes(self.headroom)})"
        )
        extra = (self.where, self.note, f"time: {self.time}" if time and self.time else "")
        lines = [head] + [f"  {x}" for x in extra if x]
        for i, s in enumerate(self.suggestions, 1):
            speed = self.fix_time(s)
            lines.append(f"  fix {i}. {s}" + (f"; {speed}" if speed else "") + _fit_remark(s, self.capacity))
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        status = VERDICT_STATUS[self.verdict]
        html = (
            f"<div style='overflow-wrap:anywhere'>{badge(status)} <b>{self.verdict}</b> on {escape(self.device)}: "
            f"headroom {format_bytes(self.headroom)}</div>" + bar(self.placed_bytes, self.capacity, self.estimate.model)
        )
        extra = (self.where, self.note, self.time and f"time: {self.time}")
        html += "".join(f"<div style='overflow-wrap:anywhere'>{escape(x)}</div>" for x in extra if x)
        if self.suggestions:
            rows = [self._fix_cells(i, s) for i, s in enumerate(self.suggestions, 1)]
            html += table(["#", "change", "once made"], rows, title="fixes, in the order to try them")
        return html

    def _fix_cells(self, i: int, s: Suggestion) -> list:
        """One fix as three cells that wrap in a narrow column: the change (where it goes and what it costs
        folded under it), then its verdict, saving and speed; one that still does not fit greyed and labelled."""
        after = s.verdict_on(self.capacity)
        grey = "opacity:0.6;" if after != FITS else ""
        word = (after if after == FITS else f"still {after}") + _fit_remark(s, self.capacity, short=True)
        more = s.detail.removeprefix(s.change).lstrip(": ") or s.cost
        folded = f"<details><summary>where, cost</summary>{escape(more)}</details>" if more else ""
        wrap = f"style='{grey}overflow-wrap:anywhere;min-width:8em'"
        change = Markup(f"<div {wrap}>{escape(s.change)}{folded}</div>")
        figures = [f"saves {format_bytes(s.saving)}, total {format_bytes(s.total)}", self.fix_time(s)]
        done = Markup(f"<div style='{grey}'>{colored(word, VERDICT_STATUS[after], 'div')}"
                      + "".join(f"<div>{escape(x)}</div>" for x in figures if x) + "</div>")  # fmt: skip
        return [Markup(f"<div style='{grey}'>{i}</div>"), change, done]


def step_seconds(est: MemoryEstimate, device: Any) -> float | None:
    """Seconds per decode step of ``est`` (one new token for each of its ``batch_size`` sequences, at the mean
    context) or per LoRA step, on ``device``: :func:`~.timing.estimate_time`'s figure, the one answer to "how fast".
    None where ``device`` is not a preset with card figures (a byte count, ``"current"``: no probe runs here),
    for full fine-tuning (not timed), or for a family whose shape the time formulas lack."""
    if not isinstance(device, str) or (device.lower() not in CARDS and device.lower() not in DEVICE_SETS):
        return None
    batch = int(est.inputs.get("batch_size", 1))
    try:
        t = estimate_time(est, device.lower(), batches=(batch,))
    except (EstimateError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if t.step_seconds is not None:
        return t.step_seconds
    if est.inputs.get("training") is not None:
        return None
    return batch / t.decode_tokens_per_s[batch]


def rate_text(est: MemoryEstimate, seconds: float) -> str:
    """``~14.7 tokens/s`` (at batch B where B > 1) for a generation plan, ``~2.1 s per LoRA step`` for training."""
    if est.inputs.get("training") is not None:
        return f"{approx_duration(seconds)} per LoRA step"
    batch = int(est.inputs.get("batch_size", 1))
    return f"~{batch / seconds:,.1f} tokens/s" + (f" at batch {batch}" if batch > 1 else "")


def _per_sequence(est: MemoryEstimate, seconds: float) -> float:
    """A step's seconds per sequence it serves (the batch, or a training micro-batch): what a fix that changes
    the batch compares by (batch 1 steps faster than batch 2 yet makes fewer tokens per second)."""
    tr = est.inputs.get("training")
    return seconds / max(1, int(tr.micro_batch if tr is not None else est.inputs.get("batch_size", 1)))


def _relative(seconds: float, before: float | None) -> str:
    """``, 3.6x slower`` / ``, 1.3x faster`` than the plan; nothing within 5 % or without the plan's time."""
    if before is None or not seconds or abs(seconds / before - 1) < 0.05:
        return ""
    return f", {seconds / before:.1f}x slower" if seconds > before else f", {before / seconds:.1f}x faster"


def _placed(s: Suggestion) -> dict:
    """A split's or an offload's kind and placement in words, for ``to_dict``."""
    return {"kind": s.kind, "where": s.where} if isinstance(s, DeviceSuggestion) else {}


def _fit_remark(s: Suggestion, capacity: int, short: bool = False) -> str:
    """What a fix leaves: nothing to say when it fits with the margin, else how little or that it falls short."""
    after = s.verdict_on(capacity)
    if after != FITS:
        return "" if short else f": still {after}, not enough alone"
    if isinstance(s, DeviceSuggestion):
        return ""  # the placement kept each card's margin (see DeviceSuggestion.verdict_on)
    spare = int(capacity * TIGHT_FRACTION) - s.estimate.total
    if spare >= fix_margin(capacity):
        return ""
    return f", {format_bytes(spare)} to spare" if short else f": fits with only {format_bytes(spare)} to spare"


def format_params(n: int) -> str:
    """``7.24 B``, ``494.0 M``, ``853.1 K`` parameters."""
    for unit, f in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= f:
            return f"{n / f:.{2 if unit == 'B' else 1}f} {unit}"
    return str(n)


def _jsonable(kw: dict) -> dict:
    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in kw.items()}


def fit_one_card(
    est: MemoryEstimate, device: Any = None, *, suggest: bool = True, gpus: int | None = None, place: Any = None,
    spilled: bool = False,
) -> FitVerdict:  # fmt: skip
    """Compare ``est`` with a device ("t4", a preset, "current", or bytes; default: the estimate's).

    When it is tight or does not fit, ``suggestions`` lists changes ranked by whether they make it
    fit and by how much they save, each computed by re-estimating. For a machine (a preset, a set such
    as ``"kaggle-2xt4"``, a list of presets, ``"current"``) they also say what :func:`helpers.plan_devices`
    places past one card: split over the machine's GPUs, else some layers offloaded to CPU RAM.

    Args:
        device: the verdict is on one card: a set's or a list's first, ``"current"``'s GPU 0.
        gpus: how many of these cards a split may use: ``"t4", gpus=2`` plans for two T4s; for a set or
            ``"current"``, at most this many of theirs. ``None``: every GPU the device names.
        place: what plans the fixes past one card, ``place(est, cards, host_ram=...)``; ``helpers.fit``
            (:func:`helpers.fit`) passes ``device_fixes``, which places with
            ``helpers.placement.device_plan``, a layer above this one. ``None``: same-card fixes only.
        spilled: rank the fixes even though the estimate fits: the placement (a layer above) found that
            transformers would leave weights for the CPU, so the plan does not fit as it stands.
    """
    flag("suggest", suggest, error=EstimateError)
    if not isinstance(est, MemoryEstimate):
        raise EstimateError(
            f"fit() compares an estimate with a device, got {type(est).__name__} {est!r:.60}: "
            "call fit(estimate(model, load=...), device)"
        )
    if device is None:
        device = est.inputs.get("device") or DEFAULT_DEVICE
    device, cards, of = target_cards(device, gpus)
    label, dev = resolve_device(device)
    if dev is None:
        raise EstimateError("no CUDA device here: pass device='t4' (or another preset, or a byte count)")
    if _device_changes_rows(est, device, dev) and est.source is not None:
        est = est.replace(device=device)  # compute dtype, attention kernel and cuBLAS workspace follow the device
    cap = dev["capacity"]
    result = verdict(est.total, cap)
    note = _capacity_note(est.total, dev)
    if est.lower_bounds and result != DOES_NOT_FIT:  # at least the total: never "fits" with the headroom shown
        result, note = TIGHT, (f"at least {format_bytes(est.total)}: {', '.join(r.name for r in est.lower_bounds)} "
                               f"is only a lower bound, so the headroom is at most {format_bytes(cap - est.total)}")  # fmt: skip
    out = FitVerdict(result, cap - est.total, cap, label + of, est, note=note)
    out.seconds = step_seconds(est, device)
    if suggest and (result != FITS or spilled) and est.source is not None:
        out.suggestions = _suggestions(est, device, cap, bf16=bool(dev.get("bf16")))
        for s in out.suggestions:
            s.seconds = step_seconds(s.estimate, device)
        if place is not None and cards and est.inputs.get("training") is None:  # training: DDP/FSDP's ground
            out.suggestions += place(est, cards, host_ram=None if device == "current" else HOST_RAM)
        out.suggestions.sort(key=lambda s: _rank(s, est, cap))
    return out


def target_cards(device: Any, gpus: int | None) -> tuple[Any, list | None, str]:
    """``(the card the verdict is on, the cards a fix may place the model over, what the label adds)``.
    A byte count or a described GPU gets no cards: it is a budget a caller computed (free memory, cards
    added up), not a machine whose GPUs and RAM are known, so no split or offload is suggested for it."""
    whole_number("gpus", gpus, none_ok=True, error=EstimateError)
    named, here = device_set(device), isinstance(device, str) and device.strip().lower() == "current"
    if isinstance(device, list | tuple) or named is not None or here:
        many = list(named or device) if not here else [d for _, d in resolve_devices("current")] or ["current"]
        if not many:
            raise EstimateError("fit() got an empty list of devices: pass a preset such as 't4' or ['t4', 't4']")
        if gpus is not None and gpus > len(many):
            raise EstimateError(f"gpus={gpus}, and {device!r} has {len(many)} GPU(s)")
        cards = many[: gpus or len(many)]
        first = "current" if here else many[0]
        return first, cards, f" (GPU 0 of {device if named else len(many)})" if len(many) > 1 else ""
    if isinstance(device, str):
        return device, [device] * (gpus or 1), f" (one of {gpus})" if gpus and gpus > 1 else ""
    return device, None, ""


def _capacity_note(total: int, dev: dict) -> str:
    """Why a plan that fits the preset may not fit the card: it lies between the lowest total such
    cards report and the preset's (verdict() already calls it tight there: over 90 % of the card)."""
    low, high = capacity_range(dev)
    if not low < total <= high:
        return ""
    return (
        f"tight because the card's total varies: it fits the {format_bytes(high)} this preset assumes but not "
        f"the {format_bytes(low)} that {dev.get('capacity_low_seen', 'some of these cards')} report "
        f"({format_bytes(total - low)} short "
        "there); cut it below that to be sure"
    )


def _device_changes_rows(est: MemoryEstimate, device, dev: dict) -> bool:
    """Whether the estimate's rows would differ on ``dev``: bf16 support (compute dtype, GQA without
    flash attention, bitsandbytes' 4-bit rule) or the cuBLAS workspace."""
    own_device = est.inputs.get("device")
    _, own = resolve_device(own_device)
    if (own or {}).get("bf16") != dev.get("bf16") or (own or {}).get("capability") != dev.get("capability"):
        return True
    return cublas_workspace(own_device, own) != cublas_workspace(device, dev)


def _candidates(est: MemoryEstimate, device, cap, bf16: bool = True) -> list[tuple[str, dict]]:
    inp = est.inputs
    tr = inp.get("training")
    cands: list[tuple[str, dict]] = []
    if est.quantized_by == "mxfp4" and est.load == BF16 and inp.get("load") != BF16:  # dequantized: no kernels
        cands.append(("pip install -U kernels triton (transformers then keeps mxfp4)", {"load": "mxfp4"}))
    for load in lighter_loads(est.load, bf16):  # a T4 or V100 has no bf16
        if tr is not None and isinstance(tr, FullTraining) and load in QUANTIZED:
            cands.append(
                (
                    f"QLoRA: load={load} with LoraTraining()",
                    {"load": load, "training": LoraTraining(seq_len=tr.seq_len, micro_batch=tr.micro_batch)},
                )
            )
            continue
        cands.append((f"load={load}", {"load": load}))
    if est.load in FOUR_BIT and not inp.get("double_quant"):
        cands.append(("double_quant=True", {"double_quant": True}))
    cands += _reducer_candidates(inp, tr)
    room = _comfortable(cap)  # a fix leaves the margin a "fits" verdict needs and a little more, not 7 MiB
    if tr is None:
        n = max_new_tokens_that_fit(est, device=room)
        if 0 < n < inp["max_new_tokens"]:
            cands.append((f"max_new_tokens={n}", {"max_new_tokens": n}))
        if inp["batch_size"] > 1:
            bmax = max_batch_that_fits(est, device=room)
            cands.append((f"batch_size={max(1, bmax)}", {"batch_size": max(1, bmax)}))
        if inp["prompt_tokens"] > 128:
            p = inp["prompt_tokens"] // 2
            cands.append((f"prompt_tokens={p} (truncate inputs)", {"prompt_tokens": p}))
        cands += _family_candidates(inp)
    else:
        if not tr.gradient_checkpointing:
            cands.append(
                ("gradient_checkpointing=True", {"training": dataclasses.replace(tr, gradient_checkpointing=True)})
            )
        if OPTIMIZERS.get(tr.optimizer) in (None, 8):
            cands.append(
                ("optimizer=paged_adamw_8bit", {"training": dataclasses.replace(tr, optimizer="paged_adamw_8bit")})
            )
        if tr.micro_batch > 1:
            cands.append(
                (
                    f"micro_batch=1 (gradient accumulation x{tr.micro_batch})",
                    {"training": dataclasses.replace(tr, micro_batch=1)},
                )
            )
        if tr.seq_len > 128:
            cands.append((f"seq_len={tr.seq_len // 2}", {"training": dataclasses.replace(tr, seq_len=tr.seq_len // 2)}))
        if isinstance(tr, FullTraining) and est.load not in QUANTIZED:
            cands.append(
                (
                    "LoRA instead of full fine-tuning",
                    {
                        "training": LoraTraining(
                            seq_len=tr.seq_len,
                            micro_batch=tr.micro_batch,
                            gradient_checkpointing=tr.gradient_checkpointing,
                        )
                    },
                )
            )
    return cands


def _family_candidates(inp: dict) -> list[tuple[str, dict]]:
    """A VLM's fewer or smaller images, a text encoder's shorter input: what only a family's inputs change
    (Whisper's audio is one padded 30 s window whatever its length: shorter clips save nothing)."""
    cands: list[tuple[str, dict]] = []
    images = inp.get("images")
    if images is not None and images > 1:
        fewer = images // 2
        cands.append((f"images={fewer} (fewer images per prompt)", {"images": fewer}))
    size = inp.get("image_size")
    if size is not None:  # only where the processor keeps the resolution (Qwen2-VL) does it change the tokens
        h, w = (size, size) if isinstance(size, int) else size
        if h * w > 224 * 224:
            half = (max(1, h // 2), max(1, w // 2))
            cands.append((f"image_size={half} (downscale the images)", {"image_size": half}))
    enc = inp.get("encoder_tokens")
    if enc is not None and enc > 128:
        cands.append((f"encoder_tokens={enc // 2} (truncate the encoder input)", {"encoder_tokens": enc // 2}))
    return cands


# What a reducer costs in speed, besides the host RAM and PCIe time its rows say (estimator/reducers.py)
_SPEED = {
    "loss=chunked": "the output layer's matmul once more per step (recomputed in backward)",
    "loss=fused": "none (Liger's kernel is as fast or faster)",
    "kv_cache=fp8": "a layer dequantized per token; 8-bit keys and values (outputs may differ slightly)",
    "kv_cache=int4": "a layer dequantized per token; 4-bit keys and values (outputs may differ)",
    "kv_cache=int2": "a layer dequantized per token; 2-bit keys and values (outputs differ more)",
}


def _reducer_candidates(inp: dict, tr) -> list[tuple[str, dict]]:
    """The memory reducers that apply here: the backend is installed and the GPU runs it."""
    if tr is None:
        if inp.get("kv_cache", "dynamic") != "dynamic":
            return []
        kinds = [k for k in ("fp8", "int4", "offload") if kv_cache_available(k, cuda=True)[0]]
        return [(f"kv_cache={k}", {"kv_cache": k}) for k in kinds]
    out = []
    if tr.loss == "plain":
        out.append(("loss=chunked", {"training": dataclasses.replace(tr, loss="chunked")}))
        if liger_available():
            out.append(("loss=fused", {"training": dataclasses.replace(tr, loss="fused")}))
    if not tr.offload_activations and not tr.gradient_checkpointing:  # checkpoints hold their inputs on the GPU
        out.append(("offload_activations=True", {"training": dataclasses.replace(tr, offload_activations=True)}))
    return out


def _single_changes(est: MemoryEstimate, device, cap, bf16: bool) -> list[Suggestion]:
    out = []
    for change, kw in _candidates(est, device, cap, bf16):
        try:
            new = est.replace(**kw)
        except EstimateError:
            continue
        if new.host_total > HOST_RAM // 2:  # the process, the data and the tokenizer need the rest
            continue
        if new.total < est.total:
            cost = "; ".join(filter(None, (_SPEED.get(change, ""), host_cost(new.host_rows))))
            out.append(Suggestion(change, kw, est.total - new.total, new, cost))
    return out


def _combined(est: MemoryEstimate, singles: list[Suggestion], device, cap, bf16: bool, steps: int = 3):
    """When no one change fits: the largest saving, then the largest on what is left, and so on (at
    most ``steps`` changes), as one suggestion; None when even that does not fit with the margin. A
    combination that fits with less than :func:`fix_margin` to spare takes one more step if it has one."""
    current, changes, kwargs, fitting = est, [], {}, None
    options = singles
    for _ in range(steps):
        if not options:
            break
        best = max(options, key=lambda s: s.saving)
        setting = best.change.split("=", 1)[0]  # a later step on the same setting replaces the earlier one
        changes = [c for c in changes if c.split("=", 1)[0] != setting] + [best.change]
        current, kwargs = best.estimate, {**kwargs, **best.kwargs}
        if verdict(current.total, cap) == FITS:
            fitting = Suggestion(" + ".join(changes), kwargs, est.total - current.total, current)
            if current.total <= _comfortable(cap):
                break
        options = _single_changes(current, device, cap, bf16)
    return fitting


def _suggestions(est: MemoryEstimate, device, cap, bf16: bool = True) -> list[Suggestion]:
    out = _single_changes(est, device, cap, bf16)
    if out and not any(verdict(s.estimate.total, cap) == FITS for s in out):
        both = _combined(est, out, device, cap, bf16)  # ranked first below: the only way that fits
        if both is not None:
            out.append(both)
    smaller = _smaller_model(est, cap)
    if smaller is not None:
        out.append(smaller)
    out.sort(key=lambda s: _rank(s, est, cap))
    return out


def _rank(s: Suggestion, est: MemoryEstimate, cap: int) -> tuple[int, bool, bool, bool, bool, bool, int]:
    """Changes that fit with the margin and a little more first, then those that fit with less, then
    the rest by saving. Among those that fit: the user's model before another, changes that keep the
    user's inputs (batch size, load mode, most of the new tokens) before truncating them, a memory
    reducer (which keeps every setting: its cost is listed) before a change of settings, then the
    least drastic (smallest saving).

    Past one card: a split over several GPUs ranks after the same-card fixes that keep the inputs (a
    model that fits one card leaves the other free for a second model or DDP, and skips the pipeline
    hop: load() itself keeps such a model on GPU 0) and before those that truncate them or change the
    model. An offload fits but makes every token several times slower (its weights cross PCIe each
    forward), so it ranks after every fix that fits the GPU at full speed, before those that do not fit."""
    total = s.total
    if isinstance(s, DeviceSuggestion) or s.placed is not None:
        tier = 0 if s.verdict_on(cap) == FITS else 2
    else:
        tier = 0 if total <= _comfortable(cap) else (1 if verdict(total, cap) == FITS else 2)
    slow = isinstance(s, DeviceSuggestion) and s.kind == "offload"
    split = isinstance(s, DeviceSuggestion) and s.kind == "split"
    reducer = s.change in _SPEED or s.change.startswith(("kv_cache=", "offload_activations"))
    return (max(tier, 1) if slow else tier, slow, "model" in s.kwargs, _cuts_inputs(s.kwargs, est), split,
            not reducer, s.saving if tier < 2 else -s.saving)  # fmt: skip


def rank_fixes(fixes: list[Suggestion], est: MemoryEstimate, capacity: int) -> list[Suggestion]:
    """``fixes`` in the order to try them (see :func:`_rank`): those that fit first, those that still do not last."""
    return sorted(fixes, key=lambda s: _rank(s, est, capacity))


def _cuts_inputs(kwargs: dict, est: MemoryEstimate) -> bool:
    """Whether a fix drops part of what the user asked for: a truncated prompt or training sequence, or
    fewer than half the new tokens."""
    if "prompt_tokens" in kwargs:
        return True
    if "max_new_tokens" in kwargs and 2 * kwargs["max_new_tokens"] < est.inputs.get("max_new_tokens", 0):
        return True
    before, after = est.inputs.get("training"), kwargs.get("training")
    return before is not None and after is not None and after.seq_len < before.seq_len


def past_context(est: MemoryEstimate) -> str:
    """Why ``est``'s tokens (prompt + new, or the training sequence) do not fit the model's context: the
    estimate's own note on it (one wording), or "" when they fit or the config gives no context."""
    if est.context is None or _tokens(est) <= est.context:
        return ""
    said = next((w for w in est.warnings if "context" in w and str(est.context) in w), "")
    return said or f"{_tokens(est)} tokens is past this model's context of {est.context}"


def _tokens(est: MemoryEstimate) -> int:
    tr = est.inputs.get("training")
    return tr.seq_len if tr is not None else est.inputs["prompt_tokens"] + est.inputs["max_new_tokens"]


_SHIPPED_PARAMS: dict[str, int | None] = {}  # hub id -> parameter count (None: its config does not estimate)


def _shipped_by_size() -> list[tuple[int | None, str]]:
    """The shipped configs, largest first (parameter counts from one estimate each, kept: a slider move
    asks again each time); those whose count is unknown come last."""
    for hub_id in shipped_configs():
        if hub_id not in _SHIPPED_PARAMS:
            try:
                _SHIPPED_PARAMS[hub_id] = estimate(hub_id).params
            except Exception:  # noqa: BLE001 - estimated with the caller's settings below, or skipped
                _SHIPPED_PARAMS[hub_id] = None
    ranked = [(_SHIPPED_PARAMS[h], h) for h in shipped_configs()]
    return sorted(ranked, key=lambda pair: -1 if pair[0] is None else pair[0], reverse=True)


def _smaller_model(est: MemoryEstimate, cap: int) -> Suggestion | None:
    """The largest shipped model of the same family (a speech model for Whisper, never a text LM) smaller than
    this one that fits with the same settings and whose context holds the prompt and the new tokens (or the
    training sequence)."""
    best = None
    try:
        own = family(resolve_config(est.source)[0])
    except Exception:  # noqa: BLE001 - a source that no longer resolves has no smaller sibling to offer
        return None
    for params, hub_id in _shipped_by_size():  # largest first: the first that fits is the answer
        if params is not None and (params >= est.params or (best is not None and params <= best.params)):
            continue
        try:
            if family(resolve_config(hub_id)[0]) != own:
                continue
            new = estimate(hub_id, **est.inputs)
        except Exception:
            continue
        if new.context is not None and new.context < _tokens(est):
            continue
        if new.params < est.params and new.total <= cap * TIGHT_FRACTION and (best is None or new.params > best.params):
            best = new
    if best is None:
        return None
    return Suggestion(
        f"a smaller model: {best.model} ({format_params(best.params)} parameters)",
        {"model": best.model},
        est.total - best.total,
        best,
    )


def _search(est: MemoryEstimate, key: str, cap: int, lo: int, hi: int) -> int:
    """Largest value of ``key`` in [lo, hi] whose estimate fits ``cap`` (lo - 1 when none)."""
    if est.replace(**{key: lo}).total > cap:
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if est.replace(**{key: mid}).total <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _as_estimate(model_or_est, kwargs) -> MemoryEstimate:
    if isinstance(model_or_est, MemoryEstimate):
        return model_or_est.replace(**kwargs) if kwargs else model_or_est
    kwargs.setdefault("load", "fp16")
    return estimate(model_or_est, **kwargs)


def _capacity(device) -> int:
    _, dev = resolve_device(device)
    if dev is None:
        raise EstimateError("no CUDA device here: pass device='t4' (or another preset, or a byte count)")
    return dev["capacity"]


def max_new_tokens_that_fit(model_or_estimate, *, device: Any = DEFAULT_DEVICE, limit: int = 1 << 20, **kwargs) -> int:
    """The largest ``max_new_tokens`` that fits ``device`` and the model's context (prompt + new tokens
    <= ``max_position_embeddings`` where the config has it); -1 when no length fits: the prompt alone
    does not fit the device, or is past the context."""
    whole_number("limit", limit, error=EstimateError)
    est = _as_estimate(model_or_estimate, kwargs)
    if est.context is not None:
        limit = min(limit, est.context - est.inputs["prompt_tokens"])
        if limit < 0:
            return -1
    return _search(est, "max_new_tokens", _capacity(device), 0, limit)


def max_batch_that_fits(model_or_estimate, *, device: Any = DEFAULT_DEVICE, limit: int = 4096, **kwargs) -> int:
    """The largest ``batch_size`` that fits ``device`` (0 when batch 1 does not fit)."""
    whole_number("limit", limit, error=EstimateError)
    est = _as_estimate(model_or_estimate, kwargs)
    return _search(est, "batch_size", _capacity(device), 1, limit)
