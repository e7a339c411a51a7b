"""export_hf: the checkpoint, loaded by transformers offline, computes what the course model computes."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network, ever: the course runs offline

import pytest
import torch
from safetensors.torch import load_file

from course_lib.inference.generate import generate
from course_lib.model import configs
from course_lib.model import tokenizer as course_tokenizer
from course_lib.model.hf_export import export_hf
from course_lib.model.transformer import Transformer

PROMPT = "ba de fi go ku la me ni"


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def exported(request, tmp_path_factory):
    """A seeded tiny model, exported and reloaded as transformers' LlamaForCausalLM + AutoTokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    model = Transformer(configs.get("tiny", tie_embeddings=request.param)).eval()
    path = export_hf(model, tmp_path_factory.mktemp("hf_tiny"))
    hf = LlamaForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, hf, tokenizer, path


def test_checkpoint_files_and_names(exported):
    model, _, _, path = exported
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == model.cfg.n_kv_heads
    assert config["head_dim"] == model.cfg.head_dim and config["intermediate_size"] == model.cfg.d_ff
    assert config["tie_word_embeddings"] == model.cfg.tie_embeddings
    names = set(load_file(path / "model.safetensors"))
    assert "model.layers.1.self_attn.q_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert ("lm_head.weight" in names) == (not model.cfg.tie_embeddings), (
        "lm_head.weight is written only for untied embeddings; tied checkpoints re-tie it on load"
    )
    assert (path / "tokenizer.json").exists(), "export_hf must write the tokenizer (tokenizer.save_hf_tokenizer)"


def test_tokenizer_matches_course_encoding(exported):
    _, _, tokenizer, _ = exported
    assert tokenizer(PROMPT)["input_ids"] == course_tokenizer.encode(PROMPT), (
        "the exported tokenizer must give the same ids as course_lib.model.tokenizer.encode"
    )


def test_tied_weights_stay_tied_in_transformers(exported):
    model, hf, _, _ = exported
    tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert tied == model.cfg.tie_embeddings, (
        f"tie_embeddings={model.cfg.tie_embeddings} but transformers' lm_head and embed_tokens are "
        f"{'one tensor' if tied else 'two tensors'}: config.json's tie_word_embeddings is wrong"
    )
    torch.testing.assert_close(hf.lm_head.weight, model.output.weight, rtol=0, atol=0)


def test_logits_match_transformers(exported):
    model, hf, tokenizer, _ = exported
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    more = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, more], dim=1)  # 48 tokens: the prompt, then every kind of id incl. specials
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    # Why a tolerance and not bit-equality: transformers computes RoPE's angles with a matmul and
    # picks its own attention kernel (sdpa/eager, its own repeat_kv), and float addition is not
    # associative, so on another build or device the last bits can differ. (On the course's CPU
    # build the difference happens to be exactly 0.)
    assert diff < 1e-5, (
        f"course model and transformers' LlamaForCausalLM disagree by {diff:.2e} (fp32, max |Δlogit|). "
        f"A large gap means a renamed weight went to the wrong place, or the RoPE convention differs "
        f"(the course model rotates halves, like transformers' rotate_half)."
    )


def test_greedy_generation_matches_transformers(exported):
    # Note: the tied random model mostly repeats its last token (its logits are h·Eᵀ, and h still
    # resembles the input embedding); the untied one gives a less trivial sequence.
    model, hf, tokenizer, _ = exported
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    ours = generate(model, prompt, 20)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(ours, theirs), (
        f"greedy decoding differs:\n  course_lib:   {course_tokenizer.decode(ours[0])}\n  transformers: "
        f"{course_tokenizer.decode(theirs[0])}\n(transformers uses a KV cache; equal logits must give equal argmaxes "
        f"unless two logits tie to within ~1e-6)"
    )
