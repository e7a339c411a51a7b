"""Group Relative Policy Optimization, GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1),
the reinforcement learning of DeepSeek-R1 (arXiv:2501.12948, §2.2.1).

PPO baselines the reward with a learned value network as large as the policy. GRPO drops it: for
each prompt q it samples a *group* of G outputs o_1..o_G from the old policy, scores them r_1..r_G,
and uses the group itself as the baseline (outcome supervision, §4.1.2: every token of o_i gets its
output's advantage):

    Â_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + eps)

    J(θ) = 1/G Σ_i 1/|o_i| Σ_t [ min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1−ε, 1+ε) Â_i) − β · KL_{i,t} ]      (eq. 3)

    ρ_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    KL_{i,t} = π_ref/π_θ − log(π_ref/π_θ) − 1                                                  (eq. 4)

The KL to a frozen reference policy is the "k3" estimator (Schulman 2020, "Approximating KL
divergence"): unbiased for KL(π_θ ‖ π_ref) when o ~ π_θ, and never negative. Unlike PPO it sits in
the loss, not in the reward. The loss minimised is −J. DeepSeekMath uses β = 0.04 and G = 64.

:func:`train_toy` runs the whole loop on a policy small enough to watch: it learns to emit the token
its prompt rewards.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

__all__ = ["ToyPolicy", "group_advantages", "grpo_loss", "kl_k3", "train_toy"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Â = (r − mean over the group) / (std over the group + eps); ``rewards`` [n_prompts, G].

    The std is the sample std (Bessel-corrected, as Hugging Face TRL's GRPOTrainer computes it; the
    paper says "std"). A group whose outputs all score the same gets Â = 0: it teaches nothing.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [n_prompts, G] with a group of G >= 2 outputs per prompt, got {tuple(rewards.shape)}: "
            f"the baseline is the group's own mean"
        )
    rewards = rewards.float()
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)


def kl_k3(logprobs: torch.Tensor, logprobs_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref): exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1 >= 0."""
    log_ratio = logprobs_ref - logprobs
    return log_ratio.exp() - log_ratio - 1


def grpo_loss(
    logprobs_new: torch.Tensor,
    logprobs_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    kl_coef: float = 0.04,
    logprobs_ref: torch.Tensor | None = None,
) -> torch.Tensor:
    """−J(θ) of eq. 3 for a batch of outputs: log-probabilities [B, T] of the sampled tokens under the
    policy being trained (with grad), the policy that sampled them and, optionally, the reference;
    ``advantages`` [B] (one per output) or [B, T]; ``mask`` [B, T], 1 on the output's tokens, 0 on
    padding. Each output's tokens are averaged (1/|o_i|), then the outputs (1/G over all B)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    mask = mask.to(logprobs_new.dtype)
    ratio = (logprobs_new - logprobs_old.detach()).exp()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    if logprobs_ref is not None:
        surrogate = surrogate - kl_coef * kl_k3(logprobs_new, logprobs_ref.detach())
    per_output = (surrogate * mask).sum(1) / mask.sum(1).clamp(min=1)
    return -per_output.mean()


class ToyPolicy(nn.Module):
    """π(o_t | q, o_{t-1}) = softmax(prompt_logits[q] + bigram_logits[o_{t-1}]): a policy with a
    prompt and one token of memory, small enough that a few dozen GRPO steps visibly change it."""

    def __init__(self, n_prompts: int, vocab: int):
        super().__init__()
        self.vocab = vocab
        # host: built on the default device like nn.Linear's weights; moved with the module by .to(device)
        self.prompt_logits = nn.Parameter(torch.zeros(n_prompts, vocab))
        # host: as above; row `vocab` is the context before the first token
        self.bigram_logits = nn.Parameter(torch.zeros(vocab + 1, vocab))

    def logits(self, prompts: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of each position of ``outputs`` [B, T] given ``prompts`` [B] and the tokens before it."""
        previous = torch.cat([torch.full_like(outputs[:, :1], self.vocab), outputs[:, :-1]], dim=1)
        return self.prompt_logits[prompts][:, None] + self.bigram_logits[previous]

    def logprobs(self, prompts: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """log π(o_t | q, o_<t) of the tokens of ``outputs``: [B, T]."""
        return self.logits(prompts, outputs).log_softmax(-1).gather(-1, outputs[..., None])[..., 0]

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
        outputs = torch.empty(len(prompts), 0, dtype=torch.long, device=prompts.device)
        previous = torch.full((len(prompts),), self.vocab, device=prompts.device)
        for _ in range(length):
            probs = (self.prompt_logits[prompts] + self.bigram_logits[previous]).softmax(-1)
            previous = torch.multinomial(probs, 1, generator=generator)[:, 0]
            outputs = torch.cat([outputs, previous[:, None]], dim=1)
        return outputs


def train_toy(
    steps: int = 40,
    n_prompts: int = 4,
    group_size: int = 8,
    length: int = 4,
    vocab: int = 8,
    lr: float = 0.1,
    inner_steps: int = 2,
    seed: int = 0,
) -> list[float]:
    """GRPO on :class:`ToyPolicy`: prompt q rewards the fraction of its output's tokens equal to
    q mod vocab. Each step samples ``group_size`` outputs per prompt from the current policy (π_old),
    takes ``inner_steps`` Adam steps on :func:`grpo_loss` (the ratio moves away from 1, so the clip
    matters), with the initial policy as π_ref. Returns the mean reward of each step's samples
    (starts near 1/vocab)."""
    # host: a one-process toy, trained on the CPU so that its curve is the same on every machine
    generator = torch.Generator().manual_seed(seed)
    policy = ToyPolicy(n_prompts, vocab)
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    # host: the CPU toy's prompts (above), [n_prompts · G], grouped by prompt
    prompts = torch.arange(n_prompts).repeat_interleave(group_size)
    mean_rewards = []
    for _ in range(steps):
        outputs = policy.sample(prompts, length, generator)
        rewards = (outputs == (prompts % vocab)[:, None]).float().mean(1)
        mean_rewards.append(rewards.mean().item())
        advantages = group_advantages(rewards.view(n_prompts, group_size)).flatten()
        mask = torch.ones_like(outputs)
        with torch.no_grad():
            old, ref = policy.logprobs(prompts, outputs), reference.logprobs(prompts, outputs)
        for _ in range(inner_steps):
            loss = grpo_loss(policy.logprobs(prompts, outputs), old, advantages, mask, logprobs_ref=ref)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mean_rewards
