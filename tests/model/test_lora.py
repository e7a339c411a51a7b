"""LoRA (course_lib.model.lora): the adapter starts as a no-op, trains alone, merges away, and matches peft."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network, ever: the course runs offline

import pytest
import torch
import torch.nn as nn

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.model import configs
from course_lib.model.hf_export import export_hf, hf_name
from course_lib.model.lora import LoRALinear, apply_lora, lora_parameters, merge_lora
from course_lib.model.transformer import Transformer
from course_lib.optim.optimizers import AdamW

R, ALPHA, TARGETS = 4, 8.0, ("wq", "wv")
# Merging changes the order of fp32 operations: x·(W + s·B·A)ᵀ instead of x·Wᵀ + s·(x·Aᵀ)·Bᵀ. Each
# logit is a sum of 64-term dot products through two layers, of size ~1, so the two orders differ by a
# few ulps of 1 (ε = 1.2e-7) per operation. Measured: 1.8e-7, with the adapter moving logits by 0.62; 1e-5
# leaves ~50x headroom and is still ~6e4 times smaller than the adapter's effect.
MERGE_ATOL = 1e-5


# one thread for the whole module: see one_thread in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def _base(seed=0):
    torch.manual_seed(seed)
    return Transformer(configs.get("tiny")).eval()


def _tokens():
    return torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))


def _train(model, steps=8, lr=1e-2):
    """A few AdamW steps on the adapters only; returns the losses."""
    ds = make_dataset(MarkovLanguage(), 8 * 64 * steps + 1, 64, seed=1)
    opt = AdamW(lora_parameters(model), lr=lr, weight_decay=0.0)
    losses = []
    for x, y in ds.batches(8, shuffle=False):
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _expected_trainable(model):
    """Σ over adapted linears of r·(d_in + d_out) (Hu et al. 2021, §4.1), from the base model's shapes."""
    return sum(
        R * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] in TARGETS
    )


def test_lora_model_starts_equal_to_base():
    base = _base()
    lora = apply_lora(copy.deepcopy(base), TARGETS, r=R, alpha=ALPHA)
    assert isinstance(lora.layers[0].attention.wq, LoRALinear) and not isinstance(
        lora.layers[0].attention.wk, LoRALinear
    )
    assert lora.layers[0].attention.wq.lora_A.abs().sum() > 0, "A must be drawn at random (B = 0 makes the no-op)"
    with torch.no_grad():
        assert torch.equal(lora(_tokens()), base(_tokens())), (
            "at init B = 0, so base(x) + (α/r)·B·A·x adds exact zeros: the LoRA model must equal the base bit for bit"
        )


def test_trainable_parameter_count_is_r_times_din_plus_dout():
    base = _base()
    expected = _expected_trainable(base)
    lora = apply_lora(copy.deepcopy(base), TARGETS, r=R, alpha=ALPHA)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    # tiny: 2 layers x (wq 64→64: 4·128, wv 64→32: 4·96) = 1792 of ~100k parameters
    assert trainable == expected == sum(p.numel() for p in lora_parameters(lora)) == 1792, (
        f"{trainable} trainable parameters, expected r·(d_in + d_out) per adapted linear = {expected}: "
        "apply_lora must freeze every base parameter and add exactly A [r, d_in] and B [d_out, r]"
    )


def test_training_changes_only_the_adapters():
    base = _base()
    lora = apply_lora(copy.deepcopy(base), TARGETS, r=R, alpha=ALPHA).train()
    losses = _train(lora)
    assert losses[-1] < losses[0] - 0.1, f"LoRA did not train: losses {losses[0]:.3f} -> {losses[-1]:.3f}"
    adapted = dict(lora.named_parameters())
    for name, p in base.named_parameters():
        ours = adapted[name.replace(".wq.", ".wq.base.").replace(".wv.", ".wv.base.")]
        assert torch.equal(ours, p), f"{name} changed during LoRA training: base weights must stay frozen"
        assert ours.grad is None, f"{name} received a gradient; frozen weights need none (that is the memory saved)"
    for module in lora.modules():
        if isinstance(module, LoRALinear):
            assert module.lora_B.abs().max() > 0, "B is still zero after training: the adapter never moved"


def test_merged_model_computes_base_plus_adapter():
    base = _base()
    lora = apply_lora(copy.deepcopy(base), TARGETS, r=R, alpha=ALPHA).train()
    _train(lora)
    lora.eval()
    x = _tokens()
    with torch.no_grad():
        adapted, before = lora(x), base(x)
        merged_model = merge_lora(copy.deepcopy(lora))
        merged = merged_model(x)
    assert not any(isinstance(m, LoRALinear) for m in merged_model.modules())
    assert set(merged_model.state_dict()) == set(base.state_dict()), "merging must give back the base's names"
    moved = (adapted - before).abs().max().item()
    diff = (merged - adapted).abs().max().item()
    assert moved > 100 * MERGE_ATOL, f"the adapter moved the logits by only {moved:.2e}: the test could not fail"
    assert diff < MERGE_ATOL, (
        f"merged logits differ from base + adapter by {diff:.2e} (adapter moved them by {moved:.2e}): "
        "merge must fold W + (α/r)·B·A with the same scaling as the forward"
    )


# ------------------------------------------------------------------------------------------------------
# Side by side with Hugging Face peft on the same model exported to transformers
# ------------------------------------------------------------------------------------------------------

# As in test_hf_export: transformers' RoPE and attention kernels may round differently on another build.
# Measured on the course's CPU build: 0.0 before and after merging, with the adapter moving logits by 0.35.
PEFT_ATOL = 1e-5


def _peft_name(course_name: str, matrix: str) -> str:
    """``layers.0.attention.wq``, ``lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``."""
    return "base_model.model." + hf_name(course_name + ".weight").removesuffix("weight") + f"{matrix}.default.weight"


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    import peft  # noqa: F401  pinned in pyproject.toml; a missing install fails here, it is not skipped
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = _base()
    path = export_hf(model, tmp_path_factory.mktemp("hf_lora"))
    hf = LlamaForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    config = LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    theirs = get_peft_model(hf, config).eval()
    ours = apply_lora(model, TARGETS, r=R, alpha=ALPHA).eval()
    generator = torch.Generator().manual_seed(2)
    peft_params = dict(theirs.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, LoRALinear):
                # B ≠ 0: a real adapter (at init both would be the base model and agree trivially)
                module.lora_B.copy_(0.05 * torch.randn(module.lora_B.shape, generator=generator))
                for matrix in ("lora_A", "lora_B"):
                    peft_params[_peft_name(name, matrix)].copy_(getattr(module, matrix))
                    copied += 1
    assert copied == 4 * ours.cfg.n_layers
    # counted now: merge_and_unload (in a test below) removes the adapters from `theirs`
    peft_trainable, _ = theirs.get_nb_trainable_parameters()
    return ours, theirs, peft_trainable


def test_peft_counts_the_same_trainable_parameters(side_by_side):
    ours, _, trainable = side_by_side
    assert trainable == sum(p.numel() for p in lora_parameters(ours)) == _expected_trainable(_base()), (
        "peft's LoraConfig(r, target_modules=['q_proj', 'v_proj']) and apply_lora(r, ('wq', 'wv')) "
        "must train the same number of parameters"
    )


def test_peft_gives_the_same_logits_before_and_after_merging(side_by_side):
    ours, theirs, _ = side_by_side
    x = _tokens()
    with torch.no_grad():
        base = _base()(x)
        a, b = ours(x), theirs(input_ids=x).logits
        moved = (a - base).abs().max().item()
        assert moved > 100 * PEFT_ATOL, f"the adapter moved the logits by only {moved:.2e}: the test could not fail"
        diff = (a - b).abs().max().item()
        assert diff < PEFT_ATOL, (
            f"course LoRA and peft LoRA disagree by {diff:.2e} with the same A and B: check the scaling α/r "
            "and which matrix is A [r, d_in] and which B [d_out, r]"
        )
        merged_model, unloaded = merge_lora(copy.deepcopy(ours)), theirs.merge_and_unload()
        merged_ours, merged_theirs = merged_model(x), unloaded(input_ids=x).logits
    for i, layer in enumerate(merged_model.layers):
        for course, hf_proj in (("wq", "q_proj"), ("wv", "v_proj")):
            # the same ops on the same tensors (W + (B @ A)·α/r, peft's order too): bit-equal, not just close
            assert torch.equal(
                getattr(layer.attention, course).weight, getattr(unloaded.model.layers[i].self_attn, hf_proj).weight
            ), f"layer {i} {course}: merged weight differs from peft's merged {hf_proj}"
    diff_merged = (merged_ours - merged_theirs).abs().max().item()
    assert diff_merged < PEFT_ATOL, (
        f"merged models disagree by {diff_merged:.2e} (course merge_lora vs peft merge_and_unload)"
    )
    assert (merged_ours - a).abs().max().item() < MERGE_ATOL
