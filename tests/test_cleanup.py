"""Cleanup really frees: tensors pinned by a stored traceback or by IPython's Out are collected."""

import sys
import weakref

import pytest
import torch

from helpers import cleanup, free, unload
from helpers.core.errors import ModelUnloadedError
from helpers.oom.reclaim import CleanupReport


def test_cleanup_frees_tensor_held_by_stored_traceback():
    refs = []

    def step():
        activations = torch.ones(1000, 1000)
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        step()
    except torch.OutOfMemoryError:
        # what the interactive interpreter and IPython do with an uncaught exception
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
    assert refs[0]() is not None, "the traceback's frame keeps the tensor alive"
    report = cleanup()
    assert refs[0]() is None
    assert "sys.last_traceback" in report.dropped


# a cell's function that holds a 4 MB tensor when the CPU allocator really fails
STEP = (
    "import torch, weakref\n"
    "refs = []\n"
    "def step():\n"
    "    big = torch.ones(1000, 1000)\n"
    "    refs.append(weakref.ref(big))\n"
    "    torch.empty(1 << 45)\n"
)


def test_cleanup_frees_tensor_held_by_ipython_traceback(ipython_shell):
    ipython_shell.run_cell(STEP + "step()")
    ref = ipython_shell.user_ns["refs"][0]
    assert ref() is not None
    ipython_shell.run_cell("from helpers import cleanup\nreport = cleanup()")
    assert ref() is None
    assert any("last" in d for d in ipython_shell.user_ns["report"].dropped)


def test_cleanup_frees_tensors_of_an_exception_kept_in_a_variable(ipython_shell):
    """``except ... as e: err = e`` keeps the failed call's frames; cleanup clears their locals and the
    exception (message, type, where it was raised) stays printable. Before: the tensor stayed alive."""
    ipython_shell.run_cell(
        STEP + "try:\n"
        "    step()\n"
        "except RuntimeError as e:\n"
        "    err = e\n"
        "note = 'kept'"  # a variable that is not an exception is never touched
    )
    ref = ipython_shell.user_ns["refs"][0]
    assert ref() is not None, "err's traceback keeps step()'s frame and its tensor"
    ipython_shell.run_cell("from helpers import cleanup\nreport = cleanup()")
    assert ref() is None
    err = ipython_shell.user_ns["err"]
    assert "can't allocate memory" in str(err) and err.__traceback__ is not None
    assert any("frames kept by err" in d for d in ipython_shell.user_ns["report"].dropped)
    assert ipython_shell.user_ns["note"] == "kept"


def test_cleanup_frees_tensors_inside_outputs_and_exceptions_kept_in_a_list():
    """A frame holding a model output (a dict of logits) or a cache object, an exception kept in a list
    (``errors.append(e)``), and one raised from another (``from None`` included): all cleared. Before:
    only frames with a bare tensor or module were, and lists were never looked at."""

    class Cache:
        def __init__(self):
            self.layers = [{"keys": torch.ones(1 << 16)}]

    refs = []

    def failing(kind):
        out = {"logits": torch.ones(1 << 16)} if kind == "output" else Cache()
        refs.append(weakref.ref(out["logits"] if kind == "output" else out.layers[0]["keys"]))
        raise RuntimeError("CUDA out of memory")

    def wrapped():
        try:
            failing("output")
        except RuntimeError:
            raise ValueError("step failed") from None

    ns = {"errors": []}
    for kind in ("output", "cache"):
        try:
            failing(kind)
        except RuntimeError as e:
            ns["errors"].append(e)
    try:
        wrapped()
    except ValueError as e:
        ns["err"] = e
    assert all(r() is not None for r in refs)
    report = cleanup(namespace=ns)
    assert [r() for r in refs] == [None, None, None]
    assert "frames kept by errors (2 of its 2 exceptions)" in report.dropped
    assert "frames kept by err (ValueError)" in report.dropped
    assert str(ns["errors"][0]) == "CUDA out of memory" and ns["err"].__context__ is not None


def test_cleanup_leaves_generators_and_module_frames_alone():
    """A generator that yields the errors it catches keeps running after cleanup() (clearing its frame
    would close it), and an error raised at module level is not 'holding tensors' just because the
    module's globals hold a model."""

    def errors():
        buffer = torch.ones(10)  # a tensor in the generator's frame: the frame qualifies, yet must stay
        while True:
            buffer.add_(1)
            try:
                torch.empty(1 << 45)
            except RuntimeError as e:
                yield e

    gen = errors()
    namespace = {"gen": gen, "err": next(gen), "model": torch.nn.Linear(2, 2)}
    report = cleanup(namespace=namespace)
    assert isinstance(next(gen), RuntimeError)  # still running
    assert not [d for d in report.dropped if d.startswith("frames kept by")]


def test_cleanup_frees_tensor_held_by_out(ipython_shell):
    ipython_shell.run_cell("import torch, weakref\nt = torch.ones(1000, 1000)", store_history=True)
    ipython_shell.run_cell("t", store_history=True)  # displayed: now in Out and _
    ipython_shell.run_cell("w = weakref.ref(t)\ndel t", store_history=True)
    w = ipython_shell.user_ns["w"]
    assert w() is not None, "Out keeps the displayed tensor alive"
    ipython_shell.run_cell("from helpers import cleanup\nreport = cleanup()", store_history=True)
    assert w() is None
    assert any(d.startswith("Out") for d in ipython_shell.user_ns["report"].dropped)


def test_free_deletes_names_in_the_notebook_namespace(ipython_shell):
    ipython_shell.run_cell("import torch, weakref\nx = torch.ones(100)\nw = weakref.ref(x)")
    ipython_shell.run_cell("from helpers import free\nr = free('x')")
    assert "x" not in ipython_shell.user_ns
    assert ipython_shell.user_ns["w"]() is None
    assert "del x" in ipython_shell.user_ns["r"].dropped


def test_free_unknown_name_says_how_to_call_it():
    with pytest.raises(NameError, match=r"free\('model'\)"):
        free("nope_not_here", namespace={})


def test_unload_releases_weights_still_referenced_elsewhere(tiny_llama):
    from transformers import AutoModelForCausalLM

    ns = {"model": AutoModelForCausalLM.from_pretrained(tiny_llama)}
    model = ns["model"]
    holder = [model]  # e.g. a Trainer or pipeline that still references the model
    n_before = sum(p.numel() for p in model.parameters())
    assert n_before > 100_000
    report = unload(model, namespace=ns)
    assert "model" not in ns
    assert sum(p.numel() for p in holder[0].parameters()) == 0
    assert "weights" in report.dropped and "del model" in report.dropped
    assert isinstance(report, CleanupReport) and "cleanup:" in str(report)
    with pytest.raises(ModelUnloadedError, match="was unloaded .* load it again"):  # not "'weight' must be 2-D"
        holder[0](torch.tensor([[1, 2, 3]]))


def test_unload_drops_the_optimizer_state_a_trainer_keeps(tiny_llama):
    """AdamW's moments (twice the trained parameters, fp32) held through ``trainer.optimizer`` come back too."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from helpers.leaks.tensors import tensor_bytes

    start = tensor_bytes()  # what other tests' fixtures keep alive
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert state > 2 * sum(p.nbytes for p in model.parameters()) - 1024
    ns = {"model": model, "trainer": SimpleNamespace(model=model, optimizer=opt)}
    del model
    report = unload(ns["model"], namespace=ns)
    assert not opt.state and any(d.startswith("trainer.optimizer state of") for d in report.dropped)
    assert tensor_bytes() - start < 1024


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_unload_releases_quantized_weights_and_their_state(tiny_llama, mode):
    """bitsandbytes keeps more than .data: int8's CB (the int8 weight) and SCB, 4-bit's quant_state."""
    from helpers.loading.loader import load
    from helpers.loading.plan import LoadPlan

    model, _, _ = load(LoadPlan(str(tiny_llama), load=mode), check=False)
    layer = model.model.layers[0].self_attn.q_proj.weight
    held = [
        weakref.ref(t)
        for t in (getattr(layer, "CB", None), getattr(layer, "SCB", None), layer.data)
        if isinstance(t, torch.Tensor)
    ]
    state = getattr(layer, "quant_state", None)
    held += [weakref.ref(state.absmax)] if state is not None else []
    del layer, state
    assert held
    holder = [model]  # something still references the model
    unload(model, namespace={})
    assert all(ref() is None for ref in held), "a quantized weight or its state survived unload()"
    assert holder


def test_unload_rejects_non_modules():
    with pytest.raises(TypeError, match="free"):
        unload("model")


def _oom_mid_generate(model, tok, at_call: int = 3):
    """Run generate until a real allocator failure inside a decoder layer; the input ids' weak reference."""
    from helpers.oom.messages import is_oom

    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] == at_call:
            torch.empty(1 << 50, dtype=torch.uint8)  # no machine has a PiB: a real allocation failure

    enc = tok(["where is the river", "a map of the town"], return_tensors="pt", padding=True)
    probe = weakref.ref(enc["input_ids"])
    handle = model.model.layers[1].register_forward_hook(hook)
    try:
        model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    except RuntimeError as e:
        assert is_oom(e)
    finally:
        handle.remove()
    return probe


def test_release_after_oom_skips_the_full_collection_when_refcounting_freed_the_call(tiny_llama):
    """A generate that ran out of memory mid-forward dies with its exception: no gc.collect() needed."""
    import gc

    from helpers.loading.loader import load
    from helpers.oom.reclaim import release_after_oom

    model, tok, _ = load(str(tiny_llama), load="fp32", check=False)
    gc.disable()  # only refcounting may free it
    try:
        probe = _oom_mid_generate(model, tok)
        assert probe() is None, "the failed generate's frames died with the exception"
        assert release_after_oom(probe) is False
    finally:
        gc.enable()


def test_release_after_oom_collects_when_the_failed_call_is_still_alive():
    """Frames caught in a reference cycle keep the inputs alive: the full collection runs and frees them."""
    import gc

    from helpers.oom.reclaim import release_after_oom

    class Node:
        pass

    def step(x):
        loop = Node()
        loop.self, loop.x = loop, x  # a cycle refcounting cannot free
        loop.frame = sys._getframe()
        torch.empty(1 << 50, dtype=torch.uint8)

    x = torch.ones(256, 256)
    probe = weakref.ref(x)
    gc.disable()
    try:
        try:
            step(x)
        except RuntimeError:
            pass
        del x
        assert probe() is not None
        assert release_after_oom(probe) is True
        assert probe() is None
        assert release_after_oom() is True, "with nothing to go by it always collects"
    finally:
        gc.enable()


def test_unload_guards_a_peft_models_inner_model_and_keeps_what_it_keeps(tiny_llama):
    """PeftModel.generate calls the inner model directly: it says "unloaded" too. With release_weights=False the
    weights may still train, so their optimizer state stays. A dead weakref proxy in a kept frame is no crash."""
    import weakref as wr

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(r=2, target_modules=["q_proj"])
    )
    unload(peft_model, namespace={})
    with pytest.raises(ModelUnloadedError):
        peft_model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2)

    kept = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(kept.parameters())
    kept(torch.ones(1, 4)).sum().backward()
    opt.step()
    unload(kept, namespace={"opt": opt}, release_weights=False)
    assert len(opt.state) == 2

    class Node:
        pass

    def fail():
        node, parent = Node(), Node()
        node.parent = wr.proxy(parent)
        del parent  # node.parent is now a dead proxy
        raise RuntimeError("boom")

    try:
        fail()
    except RuntimeError as e:
        ns = {"err": e}
    assert isinstance(cleanup(namespace=ns), CleanupReport)


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures CPU tensors")
def test_without_a_gpu_what_was_freed_is_the_tensors_bytes_not_rss():
    """RSS keeps what malloc frees for reuse: cleanup said "RAM 0 B freed" for 8 MiB of tensors gone. The
    tensors' bytes (reclaim.held, which the per-cell line reads too) are the answer; RSS is what went back."""
    ns = {"x": torch.ones(2 << 20)}  # 8 MiB
    report = free("x", namespace=ns)
    assert 8 << 20 <= report.tensors_freed < 9 << 20 and report.freed.memory == report.tensors_freed
    assert str(report).startswith("cleanup: tensors 8.00 MiB freed (RAM ") and "back to the OS" in str(report)
    assert "RAM 0 B freed" not in str(report)
