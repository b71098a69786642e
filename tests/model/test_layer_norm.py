"""model/vit.py's LayerNorm: nn.LayerNorm, whose bf16 / fp16 CPU backward sums the weight and bias
gradients in fp32, as CUDA's does; the ViT and the MAE decoder normalise with it everywhere."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from model import create_model
from model.init import mae_init_
from model.mae_decoder import MAEDecoder
from model.layer_norm import LayerNorm

ROWS, DIM = 20_000, 64  # a micro-batch of 100 images of 196 tokens, plus some


class Ops(TorchDispatchMode):
    """The names of the aten ops run inside it, in order (`seen`)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def affine_grads(norm: nn.LayerNorm, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norm.zero_grad()
    norm(x).backward(upstream)
    return norm.weight.grad.float(), norm.bias.grad.float()


def reference_grads(x: torch.Tensor, upstream: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook gradients in fp64 from the same (rounded) inputs: d weight = sum_rows(g * x_hat),
    d bias = sum_rows(g), x_hat the row standardised with the biased variance."""
    x, g = x.double(), upstream.double()
    x_hat = (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    return (g * x_hat).sum(0), g.sum(0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weight_and_bias_gradients_on_the_cpu_are_summed_in_fp32(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, DIM, generator=g).to(dtype)
    upstream = (torch.randn(ROWS, DIM, generator=g) * 0.01 + 0.001).to(dtype)  # a shared sign, as real gradients have
    ours = LayerNorm(DIM, eps=1e-6).to(dtype)
    plain = nn.LayerNorm(DIM, eps=1e-6).to(dtype)
    want_w, want_b = reference_grads(x, upstream, 1e-6)
    got_w, got_b = affine_grads(ours, x, upstream)
    # one rounding of each fp32 sum into the parameter's dtype (bf16: 2**-9 relative)
    assert relative(got_w, want_w) < 4e-3 and relative(got_b, want_b) < 4e-3
    if dtype == torch.bfloat16:  # why the class exists: PyTorch's own CPU kernel sums in 16 bits
        plain_w, plain_b = affine_grads(plain, x, upstream)
        assert max(relative(plain_w, want_w), relative(plain_b, want_b)) > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_outputs_and_input_gradients_are_nn_layer_norms_within_one_rounding(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, DIM, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(64, 3, DIM, generator=g).to(dtype)
    ours, plain = LayerNorm(DIM, eps=1e-6), nn.LayerNorm(DIM, eps=1e-6)
    with torch.no_grad():
        plain.weight.normal_(1.0, 0.1, generator=g), plain.bias.normal_(0.0, 0.1, generator=g)
    ours.load_state_dict(plain.state_dict())
    ours, plain = ours.to(dtype), plain.to(dtype)
    (grad_ours,) = torch.autograd.grad(y_ours := ours(x), x, upstream)
    (grad_plain,) = torch.autograd.grad(y_plain := plain(x), x, upstream)
    assert y_ours.dtype == dtype and y_ours.shape == x.shape
    tol = 2 * torch.finfo(dtype).eps
    assert relative(y_ours, y_plain) < tol and relative(grad_ours, grad_plain) < tol


def test_fp32_takes_nn_layer_norms_own_path_bit_for_bit():
    x = torch.randn(8, 5, DIM, requires_grad=True)
    ours, plain = LayerNorm(DIM, eps=1e-6), nn.LayerNorm(DIM, eps=1e-6)
    assert torch.equal(ours(x), plain(x))
    assert set(ours.state_dict()) == set(plain.state_dict()) == {"weight", "bias"}


def test_the_vit_and_the_mae_decoder_normalise_with_it_everywhere():
    encoder = create_model("vit_debug_patch4")
    decoder = MAEDecoder((7, 7), 4, 1, encoder.embed_dim, decoder_dim=32, depth=1, num_heads=2)
    norms = [m for model in (encoder, decoder) for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) >= 2 * len(encoder.blocks) + 1 + 2 * len(decoder.decoder_blocks) + 1
    assert all(type(m) is LayerNorm and m.eps == 1e-6 for m in norms)
    for m in norms:  # the MAE init still reaches them (it looks for nn.LayerNorm)
        nn.init.normal_(m.weight), nn.init.normal_(m.bias)
    mae_init_(encoder), mae_init_(decoder)
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) and not m.bias.any() for m in norms)


def test_inside_norms_as_on_cuda_the_cpu_takes_nn_layer_norms_own_kernel():
    """What the launch census counts on the CPU is the CUDA step's path: one layer-norm op, no casts."""
    from model.layer_norm import norms_as_on_cuda

    x = torch.randn(ROWS, DIM).bfloat16()
    ours, plain = LayerNorm(DIM, eps=1e-6).bfloat16(), nn.LayerNorm(DIM, eps=1e-6).bfloat16()
    with norms_as_on_cuda():
        assert torch.equal(ours(x), plain(x))
        with torch.profiler.profile() as prof:
            ours(x)
    assert not any(e.name in ("aten::_to_copy", "aten::to") for e in prof.events())
    with torch.profiler.profile() as prof:  # and after the block, the fp32 path again
        ours(x)
    assert any(e.name == "aten::_to_copy" for e in prof.events())



def test_a_block_of_norms_as_on_cuda_that_raises_restores_the_fp32_path():
    """A census step that fails inside the block must not leave every later CPU run on the 16-bit path."""
    from model.layer_norm import norms_as_on_cuda

    with pytest.raises(RuntimeError, match="a step failed"), norms_as_on_cuda():
        assert not LayerNorm.cpu_in_fp32
        raise RuntimeError("a step failed")
    assert LayerNorm.cpu_in_fp32

def test_off_the_cpu_a_16_bit_input_takes_nn_layer_norms_own_op():
    """A device other than the CPU (the meta device standing in for CUDA) runs aten's layer norm on
    the bf16 input itself: no cast in, no cast out."""
    norm = LayerNorm(DIM, eps=1e-6, device="meta", dtype=torch.bfloat16)
    x = torch.empty(8, DIM, device="meta", dtype=torch.bfloat16)
    with Ops() as ops:
        y = norm(x)
    assert y.dtype == torch.bfloat16 and "native_layer_norm" in ops.seen and "_to_copy" not in ops.seen, ops.seen
    with Ops() as ops:  # the CPU path, for contrast: the casts are there
        LayerNorm(DIM, eps=1e-6, dtype=torch.bfloat16)(torch.zeros(8, DIM, dtype=torch.bfloat16))
    assert "_to_copy" in ops.seen, ops.seen


def channels_first(rows: torch.Tensor) -> torch.Tensor:
    """(N*H*W, C) rows -> the (N, C, H, W) tensor whose channels they are (H = W = 20)."""
    return rows.reshape(-1, 20, 20, rows.shape[1]).permute(0, 3, 1, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["nn.LayerNorm", "timm LayerNorm2d"])
def test_another_librarys_layer_norms_sum_their_16_bit_cpu_gradients_in_fp32_once_normalised(kind, dtype):
    from timm.layers import LayerNorm2d

    from model.layer_norm import normalise_in_fp32_on_cpu

    g = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, DIM, generator=g).to(dtype)
    upstream = (torch.randn(ROWS, DIM, generator=g) * 0.01 + 0.001).to(dtype)
    want_w, want_b = reference_grads(x, upstream, 1e-6)
    if kind == "nn.LayerNorm":
        make, shape = (lambda: nn.LayerNorm(DIM, eps=1e-6)), (lambda t: t)
    else:  # ConvNeXt's: channels of an NCHW tensor
        make, shape = (lambda: LayerNorm2d(DIM, eps=1e-6)), channels_first
    plain, model = make().to(dtype), nn.Sequential(make()).to(dtype)
    assert normalise_in_fp32_on_cpu(model) is model
    norm = model[0]
    assert isinstance(norm, type(plain)) and type(norm).__name__ == type(plain).__name__
    assert set(norm.state_dict()) == set(plain.state_dict())
    got_w, got_b = affine_grads(norm, shape(x), shape(upstream))
    assert norm.weight.grad.dtype == dtype
    assert relative(got_w, want_w) < 4e-3 and relative(got_b, want_b) < 4e-3
    if dtype == torch.bfloat16:  # the class's own CPU kernel, for contrast
        plain_w, plain_b = affine_grads(plain, shape(x), shape(upstream))
        assert max(relative(plain_w, want_w), relative(plain_b, want_b)) > 0.1
    with torch.no_grad():  # outputs: the class's own in fp32, cast once
        assert torch.equal(norm(shape(x)), make()(shape(x).float()).to(dtype))


def test_a_timm_backbones_norms_take_the_fp32_path_and_keep_timms_names_and_fp32_results():
    import timm

    from model.layer_norm import InFp32OnCpu, normalise_in_fp32_on_cpu

    ours = create_model("timm/convnext_atto", img_size=32, in_chans=3)
    timms = timm.create_model("convnext_atto", pretrained=False, num_classes=0, in_chans=3)
    norms = [m for m in ours.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == sum(isinstance(m, nn.LayerNorm) for m in timms.modules()) > 2
    assert all(isinstance(m, InFp32OnCpu) for m in norms)
    timms.load_state_dict(ours.state_dict())  # strict: the same names
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(ours(x), timms(x))  # fp32: timm's own path, bit for bit
    classes = [type(m) for m in norms]
    normalise_in_fp32_on_cpu(ours)  # a second time: nothing mixed in twice
    assert [type(m) for m in norms] == classes
    ours = ours.bfloat16()
    features = ours(x.bfloat16()).float()  # (2, 320)
    # a random projection: the plain sum of a LayerNorm's output (unit weights) has no gradient
    (features * torch.randn(features.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    assert all(m.weight.grad.dtype == torch.bfloat16 and m.weight.grad.abs().sum() > 0 for m in norms)


def test_a_normalised_foreign_norm_takes_its_own_kernel_on_cuda_and_inside_norms_as_on_cuda():
    from timm.layers import LayerNorm2d
    from model.layer_norm import normalise_in_fp32_on_cpu, norms_as_on_cuda

    meta = normalise_in_fp32_on_cpu(nn.Sequential(LayerNorm2d(DIM, device="meta", dtype=torch.bfloat16)))
    with Ops() as ops:
        meta(torch.empty(2, DIM, 4, 4, device="meta", dtype=torch.bfloat16))
    assert "native_layer_norm" in ops.seen and "_to_copy" not in ops.seen, ops.seen
    cpu = normalise_in_fp32_on_cpu(nn.Sequential(LayerNorm2d(DIM))).bfloat16()
    x = torch.randn(2, DIM, 4, 4).bfloat16()
    with norms_as_on_cuda(), Ops() as ops:
        cpu(x)
    assert "native_layer_norm" in ops.seen and "_to_copy" not in ops.seen, ops.seen
    with Ops() as ops:
        cpu(x)
    assert "_to_copy" in ops.seen, ops.seen
