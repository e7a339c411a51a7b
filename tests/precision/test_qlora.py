"""QLoRA end to end: an NF4 base (precision.nf4.NF4Linear) under LoRA adapters (model.lora) on the course model.

What defines it (Dettmers et al. 2023, §3): the forward is the model with dequantized weights plus the adapters,
only the adapters train, the 4-bit base never changes, and the memory is NF4 bytes + adapter states
(cost.memory.qlora_bytes). Beside bitsandbytes' Linear4bit, which runs on CPU in the pinned 0.50.2.
"""

import copy

import pytest
import torch
import torch.nn as nn

from course_lib.cost.memory import lora_elements, nf4_bits_per_parameter, nf4_bytes, qlora_bytes
from course_lib.data import MarkovLanguage
from course_lib.experiments.lecture05.qlora_finetune import (
    BLOCK_LINEARS,
    dequantized_copy,
    make_qlora,
    qlora_held_bytes,
    train,
    val_loss,
)
from course_lib.model import configs
from course_lib.model.lora import LoRALinear, apply_lora, lora_parameters, merge_lora
from course_lib.model.transformer import Transformer
from course_lib.precision.nf4 import NF4Linear, dequantize_nf4, quantize_linears, quantize_nf4

R, ALPHA, SEQ = 8, 16.0, 32
FINETUNE_STEPS = 100
# The fine-tune's task: another Markov language (seed 1) than the one the base was trained on (seed 0), so the
# adapters have something to learn that the base does not know.
TASK = MarkovLanguage(seed=1)


# one thread for the whole module: see one_thread in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pretrained(one_thread):
    """The base: ``tiny`` trained 300 steps on the course language (val 4.16 -> 2.33; ~3 s on one thread)."""
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny", max_seq_len=SEQ))
    train(model, model.parameters(), 300)
    return model.eval()


def _qlora(base, seed=1):
    torch.manual_seed(seed)  # the adapters' A
    return make_qlora(copy.deepcopy(base), BLOCK_LINEARS, r=R, alpha=ALPHA)


def _tokens():
    return torch.randint(0, 16, (4, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def finetuned(pretrained):
    """A QLoRA fine-tune on TASK, with what it started from; and the same run on the dequantized reference."""
    model = _qlora(pretrained)
    before = copy.deepcopy(model)
    reference = dequantized_copy(model)
    losses, opt = train(model, list(lora_parameters(model)), FINETUNE_STEPS, lang=TASK, seed=1)
    ref_losses, _ = train(reference, list(lora_parameters(reference)), FINETUNE_STEPS, lang=TASK, seed=1)
    return dict(model=model, before=before, opt=opt, losses=losses, reference=reference, ref_losses=ref_losses)


def test_qlora_swaps_every_block_linear_for_nf4_and_wraps_it():
    model = _qlora(Transformer(configs.get("tiny", max_seq_len=SEQ)))
    loras = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(loras) == len(BLOCK_LINEARS) * model.cfg.n_layers
    assert all(isinstance(m.base, NF4Linear) for m in loras), "each adapter must sit beside an NF4 base"
    assert type(model.output) is nn.Linear, "the output head stays in full precision (as load_in_4bit keeps lm_head)"
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules()), "a block linear was left unquantized"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable), f"trainable: {sorted(trainable)}"
    with pytest.raises(ValueError, match="no nn.Linear named"):
        quantize_linears(Transformer(configs.get("tiny")), ("q_proj",))


def test_forward_equals_dequantized_base_plus_adapter(pretrained):
    """Bit for bit: NF4Linear computes F.linear(x, Ŵ) with Ŵ = dequantize_nf4(...), the reference nn.Linear
    computes F.linear(x, Ŵ) with the same Ŵ, and the adapters are the same tensors: the same operations on the
    same numbers. Ŵ is recomputed here from the fp32 base's weights, independently of NF4Linear."""
    model = _qlora(pretrained)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):  # B ≠ 0: a real adapter (at B = 0 it adds exact zeros)
                m.lora_B.copy_(0.05 * torch.randn(m.lora_B.shape, generator=generator))
    reference = copy.deepcopy(pretrained)
    for name, module in reference.named_modules():
        if type(module) is nn.Linear and name.rpartition(".")[2] in BLOCK_LINEARS:
            w_hat = dequantize_nf4(quantize_nf4(module.weight, double_quant=True))
            module.weight.data.copy_(w_hat)
    apply_lora(reference, BLOCK_LINEARS, r=R, alpha=ALPHA)
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    x = _tokens()
    with torch.no_grad():
        ours, theirs, fp32 = model(x), reference(x), pretrained(x)
        harness = dequantized_copy(model)(x)
    assert (ours - fp32).abs().max() > 1e-2, "quantization and adapter moved nothing: the test could not fail"
    assert torch.equal(ours, theirs), (
        f"QLoRA logits differ from (dequantized base + adapter) by {(ours - theirs).abs().max():.2e}: NF4Linear "
        "must multiply by exactly dequantize_nf4 of its stored tensor, double-quantized constants included"
    )
    assert torch.equal(ours, harness), "qlora_finetune.dequantized_copy is not the model QLoRA computes"


def test_only_adapters_train_and_the_nf4_base_stays_bit_for_bit(finetuned):
    model, before = finetuned["model"], finetuned["before"]
    after_state, before_state = model.state_dict(), before.state_dict()
    frozen = [k for k in before_state if "lora_" not in k]
    stored = [k for k in frozen if k.endswith(("packed", "absmax", "absmax_scale", "absmax_offset"))]
    assert len(stored) == 4 * len(BLOCK_LINEARS) * model.cfg.n_layers, "every NF4 layer stores 4 tensors"
    for k in frozen:  # the NF4 codes and constants, embeddings, norms, output head: all untouched
        assert torch.equal(after_state[k], before_state[k]), f"{k} changed: only the adapters may train"
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert p.grad is None, f"{name} got a gradient: frozen weights need none (that is the memory saved)"
    moved = [k for k in before_state if k.endswith("lora_B") and not torch.equal(after_state[k], before_state[k])]
    assert len(moved) == len(BLOCK_LINEARS) * model.cfg.n_layers, "every adapter's B must have moved"


def test_short_finetune_reduces_the_loss_and_is_lora_on_the_dequantized_base(pretrained, finetuned):
    start, end = val_loss(finetuned["before"], TASK), val_loss(finetuned["model"], TASK)
    # Measured: 3.095 -> 2.581 nats/token on the new language in 100 steps (its floor is 1.903, the base's
    # loss on its own language 2.33). A 0.3 drop is ~40 σ of the validation set's sampling noise (2048 tokens,
    # per-token σ ≈ 1.5 nats: σ_mean ≈ 0.03), and far above anything a frozen adapter could show (0).
    assert end < start - 0.3, f"QLoRA fine-tune: validation loss {start:.3f} -> {end:.3f} on the new language"
    # Same forward bits and same optimizer on the same adapters: the training curves are identical, not close.
    assert finetuned["losses"] == finetuned["ref_losses"], (
        "QLoRA's training curve differs from LoRA on the dequantized base: the NF4 layer's backward to x must be "
        "that of a linear layer with the dequantized weight"
    )
    # QLoRA's claim (§5): 4-bit NF4 + adapters matches 16-bit LoRA. Against LoRA on the unquantized base:
    torch.manual_seed(1)
    lora = apply_lora(copy.deepcopy(pretrained), BLOCK_LINEARS, r=R, alpha=ALPHA)
    train(lora, list(lora_parameters(lora)), FINETUNE_STEPS, lang=TASK, seed=1)
    gap = end - val_loss(lora, TASK)
    # Measured gap: −0.011 (QLoRA 2.581, fp32 LoRA 2.591). 0.05 is ~5× that, and ~10× smaller than the drop the
    # fine-tune itself makes: a base broken by its quantization would not stay within it.
    assert abs(gap) < 0.05, f"QLoRA ends {gap:+.3f} nats/token from LoRA on the fp32 base"


def test_measured_memory_equals_the_qlora_formula(finetuned):
    """Bytes held after a step (gradients and AdamW state exist) == cost.memory.qlora_bytes, to the byte."""
    model = finetuned["model"]
    measured = qlora_held_bytes(model, finetuned["opt"])
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, NF4Linear)]
    adapter_elements = lora_elements(shapes, R)
    assert measured["base"] == sum(nf4_bytes(o * i, double_quant=True) for o, i in shapes), (
        f"NF4 bytes measured {measured['base']}: codes numel/2, one 8-bit constant per 64, an fp32 scale per 256 "
        "constants, one fp32 mean per tensor"
    )
    assert measured["adapters"] == 2 * 4 * adapter_elements, "A and B and their gradients, fp32: 8 B per element"
    assert measured["optimizer"] == 2 * 4 * adapter_elements, "AdamW's m and v for the adapters only, fp32"
    formula = qlora_bytes(shapes, shapes, R, bytes_per_element=4, optimizer="adamw")
    assert measured["total"] == formula, f"measured {measured} B, cost.memory.qlora_bytes says {formula} B"
    # Tiny's matrices are 64 wide, so each holds one partial block of 256 constants: a little above 4.127 bits.
    numel = sum(o * i for o, i in shapes)
    bits = 8 * measured["base"] / numel
    assert nf4_bits_per_parameter(double_quant=True) < bits < 4.5, f"{bits:.3f} bits per base parameter"


def test_merged_qlora_model_is_dense_and_computes_the_same(finetuned):
    """Merging dequantizes (W + (α/r)·B·A is on no 4-bit grid): plain nn.Linear layers, the same function up to
    fp32 reordering — 1e-5, as MERGE_ATOL in tests/model/test_lora.py derives for this model's sizes."""
    model = finetuned["model"]
    merged = merge_lora(copy.deepcopy(model))
    assert not any(isinstance(m, (LoRALinear, NF4Linear)) for m in merged.modules())
    x = _tokens()
    with torch.no_grad():
        diff = (merged(x) - model(x)).abs().max().item()
    assert diff < 1e-5, f"merged QLoRA model differs by {diff:.2e}"


# ------------------------------------------------------------------------------------------------------
# Beside bitsandbytes' Linear4bit (bitsandbytes 0.50.2 runs it on CPU: dequantize, then F.linear)
# ------------------------------------------------------------------------------------------------------


def _bnb_linear(w, compress_statistics):
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        pytest.fail(f"bitsandbytes is not importable ({e}): install the pinned version from pyproject.toml")
    out_features, in_features = w.shape
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=False,
        compute_dtype=torch.float32,
        compress_statistics=compress_statistics,
        quant_type="nf4",
    )
    layer.weight = bnb.nn.Params4bit(
        w.clone(), requires_grad=False, compress_statistics=compress_statistics, quant_type="nf4", blocksize=64
    )
    return layer.to("cpu")  # Params4bit quantizes when it is moved to a device


def _weight_and_input():
    g = torch.Generator().manual_seed(5)
    w = 0.02 * torch.randn(128, 256, generator=g)  # 512 blocks of 64: 2 blocks of 256 constants
    w[torch.rand(w.shape, generator=g) < 1e-3] *= 8  # a few outliers, as pretrained weights have
    return w, torch.randn(2, 8, 256, generator=g)  # several tokens: bnb's 1-token path is a different kernel


def test_nf4linear_equals_bitsandbytes_linear4bit_without_double_quantization():
    w, x = _weight_and_input()
    ours = NF4Linear(quantize_nf4(w, double_quant=False))
    theirs = _bnb_linear(w, compress_statistics=False)
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    assert torch.equal(a, b), (
        f"NF4Linear and bnb Linear4bit differ by {(a - b).abs().max():.2e}: the codes and fp32 constants are equal "
        "bit for bit (tests/precision/test_nf4.py), so the forward must be the same F.linear on the same dequantized weight"
    )


def test_nf4linear_beside_bitsandbytes_with_double_quantization():
    """compress_statistics=True. The 4-bit codes are the same (both quantize with the exact fp32 c_b first);
    the second level differs by design (ours: e4m3, bnb: its dynamic 8-bit code; precision/nf4.py), so:

    1. fed bnb's own dequantized constants, NF4Linear's forward equals Linear4bit's bit for bit;
    2. with our e4m3 constants the outputs differ by exactly x·(q·Δc)ᵀ, where Δc = ĉ_ours − ĉ_bnb per block:
       |y_ours − y_bnb| ≤ |x|·(|q|·|Δc|)ᵀ + 2γ_n·|x|·|Ŵ|ᵀ, the second term the rounding of two fp32 GEMMs of
       length n = 256 (Higham's γ_n = n·u/(1 − n·u), u = 2⁻²⁴).
    """
    import bitsandbytes.functional as bnbF

    w, x = _weight_and_input()
    ours = NF4Linear(quantize_nf4(w, double_quant=True))
    theirs = _bnb_linear(w, compress_statistics=True)
    state = theirs.weight.quant_state
    assert state.nested and state.state2.blocksize == 256, "bnb must double-quantize in blocks of 256"
    assert torch.equal(ours.packed, theirs.weight.data.view(torch.uint8).reshape(-1)), "4-bit codes differ"

    c_bnb = bnbF.dequantize_blockwise(state.absmax, state.state2) + state.offset
    fed = NF4Linear(quantize_nf4(w, double_quant=False))
    fed.absmax.copy_(c_bnb)
    with torch.no_grad():
        y_ours, y_bnb, y_fed = ours(x), theirs(x), fed(x)
    assert torch.equal(y_fed, y_bnb), "with bnb's constants, NF4Linear must compute bnb's forward bit for bit"

    delta_c = dequantize_nf4(ours.nf4) - dequantize_nf4(fed.nf4)  # q·(ĉ_ours − ĉ_bnb), element by element
    n, u = w.shape[1], 2.0**-24
    gamma = n * u / (1 - n * u)
    w_abs = dequantize_nf4(fed.nf4).abs()
    bound = x.abs() @ delta_c.abs().T + 2 * gamma * (x.abs() @ w_abs.T)
    diff = (y_ours - y_bnb).abs()
    assert (diff <= bound * (1 + 1e-5)).all(), "outputs differ by more than the constants' difference explains"
    assert diff.max() > 0, "the two second-level formats agreed exactly: the comparison did not test anything"
    # measured: max diff 0.017 ≤ bound 0.051, outputs up to 1.19: the bound is a few % of the output, not vacuous
    assert bound.max() < 0.1 * y_bnb.abs().max(), "the bound is too loose to say anything"
    # Quality, not bits: against the unquantized layer both outputs carry the same 4-bit error, and the second
    # level adds little to it. Within 10 %, as tests/precision/test_nf4.py bounds the weight error (measured: 0.1 %).
    exact = x @ w.T
    rms_ours, rms_bnb = ((y_ours - exact).pow(2).mean().sqrt().item(), (y_bnb - exact).pow(2).mean().sqrt().item())
    assert abs(rms_ours - rms_bnb) <= 0.1 * rms_bnb, f"RMS output error: NF4Linear {rms_ours:.4g}, bnb {rms_bnb:.4g}"
