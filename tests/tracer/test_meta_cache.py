"""MetaKernelCache answers repeated meta calls as the kernels do, and leaves alone what it must."""

import torch
import torch.nn.functional as F

from megatron_dynapipe.tracer.meta_cache import MetaKernelCache


def layout(t):
    if isinstance(t, torch.Tensor):
        return (t.device.type, tuple(t.shape), t.stride(), t.dtype)
    if isinstance(t, (tuple, list)):
        return tuple(layout(x) for x in t)
    return t


def meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


CALLS = {
    "add": lambda a, b, w: a + b,
    "mul by scalar": lambda a, b, w: a * 0.5,
    "gelu": lambda a, b, w: F.gelu(a),
    "layer norm": lambda a, b, w: F.layer_norm(a, (a.shape[-1],), w),
    "native layer norm (three results)": lambda a, b, w: torch.ops.aten.native_layer_norm(a, [a.shape[-1]], w, None, 1e-5),
    "softmax in half": lambda a, b, w: torch.softmax(a.to(torch.bfloat16), dim=-1),
    "matmul": lambda a, b, w: a @ b.transpose(-1, -2),
    "transposed copy": lambda a, b, w: a.transpose(0, 1).contiguous() * 2,
    "transposed input (strides carry over)": lambda a, b, w: a.transpose(0, 2) * 2,
}


def test_remembered_answers_have_the_kernels_layouts():
    a, b, w = meta(6, 2, 8), meta(6, 2, 8), meta(8)
    expected = {name: layout(call(a, b, w)) for name, call in CALLS.items()}
    with MetaKernelCache() as cache:
        first = {name: layout(call(a, b, w)) for name, call in CALLS.items()}
        again = {name: layout(call(a, b, w)) for name, call in CALLS.items()}
    assert first == expected and again == expected
    assert cache.hits > 0 and cache.misses > 0


def test_a_different_shape_or_dtype_is_a_different_answer():
    with MetaKernelCache():
        assert tuple((meta(4, 8) + meta(4, 8)).shape) == (4, 8)
        assert tuple((meta(3, 5) + meta(3, 5)).shape) == (3, 5)
        assert (meta(3, 5, dtype=torch.bfloat16) + meta(3, 5, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert tuple((meta(3, 1) + meta(1, 5)).shape) == (3, 5)  # broadcast: strides differ from (3, 5)
        ints = meta(4, dtype=torch.int64)
        assert (ints * 2).dtype == torch.int64 and (ints * 2.0).dtype == torch.float32  # 2 == 2.0, yet
        assert (ints * True).dtype == torch.int64


def test_views_and_in_place_ops_are_never_answered_from_memory():
    with MetaKernelCache() as cache:
        x = meta(4, 6)
        for _ in range(3):
            v = x.view(6, 4)
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and v._base is x
            y = x.add_(1)
            assert y is x
        assert cache.hits == cache.misses == 0


def test_real_tensors_are_computed_not_remembered():
    with MetaKernelCache() as cache:
        for value in (1.0, 2.0):
            out = torch.full((3,), value) * 2
            assert out.tolist() == [2 * value] * 3
        assert cache.hits == cache.misses == 0


def test_a_module_trains_the_same_shapes_with_the_cache():
    def step():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, device="meta")
        out = layer(meta(5, 3, 16, grad=True))
        out.sum().backward()
        return layout(out), {n: layout(p.grad) for n, p in layer.named_parameters()}

    expected = step()
    with MetaKernelCache() as cache:
        assert step() == expected
        assert step() == expected
    assert cache.hits >= cache.misses > 0
