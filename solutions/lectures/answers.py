"""Reference answers to the lectures' exercises (see course_lib/grading/exercises.py).

Try each exercise before reading its answer here. The test run executes the lectures with these
answers (COURSE_REFERENCE_ANSWERS=1), so every check cell is proven to pass with them.
"""

from course_lib.cost.collective_bytes import tp_received_elements


# Lecture 01, §8: one AdamW step (Loshchilov & Hutter 2019, Alg. 2), in place.
def my_adamw_step(p, g, m, v, t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    p.mul_(1 - lr * weight_decay)  # decoupled decay: θ(1 − ηλ), outside the adaptive scaling
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    p.sub_(lr * m_hat / (v_hat.sqrt() + eps))


# Lecture 02, Part 1: model states of mixed-precision Adam per rank under ZeRO (Rajbhandari et al. 2020, §5).
def model_state_gb(psi, n, stage):
    params = 2 * psi / (n if stage >= 3 else 1)
    grads = 2 * psi / (n if stage >= 2 else 1)
    optimizer = 12 * psi / (n if stage >= 1 else 1)
    return (params + grads + optimizer) / 1e9


lowest_stage_that_fits_70b = 3  # 17.5 GB per rank; stage 2 still needs 155 GB


# Lecture 02, Part 2: the all-reduces of one tensor-parallel training step (Megatron-LM §3).
def predict_tp_step(n_layers, b, s, d):
    forward = 1 + 2 * n_layers + 3  # embedding g, two g per block, three in the cross-entropy
    backward = 2 * n_layers + 1  # two f per block, the output layer's f
    activation = b * s * d * 4  # every f and g moves one [b, s, d] fp32 activation
    total_bytes = (1 + 2 * n_layers + 2 * n_layers + 1) * activation + 3 * b * s * 4
    return forward, backward, total_bytes


# Lecture 03, §2.5: a block is B·HKV·(S/N)·D elements. Backward: K and V make the forward's N − 1 hops again, in
# their own precision; dK and dV, accumulated in fp32 as they travel, make N hops, the last one bringing them home.
def ring_backward_bytes(B, S, HKV, D, N, kv_bytes):
    block = B * HKV * (S // N) * D
    return 2 * (N - 1) * block * kv_bytes + 2 * N * block * 4


# Lecture 04, §6: a GQA layer keeps K and V, n_kv_heads x head_dim bf16 elements each, per token; a
# sliding-window layer keeps at most the last sliding_window tokens.
def kv_cache_bytes(cfg, context):
    per_token = 2 * cfg.n_kv_heads * cfg.head_dim * 2
    full = cfg.layer_types.count("full")
    sliding = cfg.layer_types.count("sliding")
    return per_token * (full * context + sliding * min(context, cfg.sliding_window))


# Lecture 05, §7: a target W [d_out, d_in] gets A [r, d_in] and B [d_out, r], r·(d_in + d_out) parameters;
# wq and wo map between d_model and n_heads·head_dim, wk and wv between d_model and n_kv_heads·head_dim.
def lora_trainable_params(cfg, targets, r):
    q = cfg.n_heads * cfg.head_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    widths = {"wq": q, "wk": kv, "wv": kv, "wo": q}
    return cfg.n_layers * sum(r * (cfg.d_model + widths[t]) for t in targets)


# Lecture 06, §2: a sequence of n tokens holds ceil(n / B) blocks of B slots; only its last block has empty slots.
def paged_waste_slots(lengths, block_size):
    return sum(-(-n // block_size) * block_size - n for n in lengths)


# Lecture 08b, §1: n GPUs failing independently, each every M_gpu seconds on average: the rates add, so the
# cluster fails every M = M_gpu / n. Lost time per second of work L(τ) = C/τ + (R + τ/2)/M (writing; per
# failure the restart and half an interval redone); L'(τ) = -C/τ² + 1/(2M) = 0 at τ* = sqrt(2CM) (Young 1974:
# R does not depend on τ, so it does not move the optimum), where L = sqrt(2C/M) + R/M.
def checkpoint_plan(n_gpus, gpu_mtbf_s, checkpoint_s, restart_s):
    mtbf = gpu_mtbf_s / n_gpus
    interval = (2 * checkpoint_s * mtbf) ** 0.5
    return interval, checkpoint_s / interval + (restart_s + interval / 2) / mtbf


# Lecture 09, §6: every scheme whose device grid exists for p, ranked by the elements a device receives;
# the list is in order of simplicity, so min() keeps the simpler scheme on a tie.
def best_tp_scheme(b, h, n, p):
    grids = ["1d"] + (["2d"] if round(p**0.5) ** 2 == p else []) + (["3d"] if round(p ** (1 / 3)) ** 3 == p else [])
    return min(grids, key=lambda s: tp_received_elements(s, b, h, n, p))


# Lecture 07, §2: I(m) = 2mnk / (b(mk + kn + mn)) rises with m towards 2nk / (b(k + n)); solving I(m) = ridge
# gives m = ridge·b·kn / (2nk − ridge·b(k + n)). Round up, then step to absorb the rounding of the division.
def compute_bound_tokens(k, n, bytes_per_element, peak_flops_per_second, bytes_per_second):
    ridge = peak_flops_per_second / bytes_per_second

    def intensity(m):
        return 2 * m * n * k / (bytes_per_element * (m * k + k * n + m * n))

    denominator = 2 * n * k - ridge * bytes_per_element * (k + n)
    if denominator <= 0:
        return None
    m = max(1, int(ridge * bytes_per_element * k * n / denominator))
    while intensity(m) < ridge:
        m += 1
    while m > 1 and intensity(m - 1) >= ridge:
        m -= 1
    return m


# Lecture 10, §1.3: tp divides every split dimension (heads, key/value heads, vocabulary, d_ff); each of
# the pp stages needs a block, and tied embeddings keep the model whole (pp = 1); dp·m divides the batch.
def valid_layouts(cfg, world, global_batch, m):
    out = set()
    for dp in range(1, world + 1):
        for tp in range(1, world + 1):
            if world % (dp * tp):
                continue
            pp = world // (dp * tp)
            if any(x % tp for x in (cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.d_ff)):
                continue
            if pp > cfg.n_layers or (cfg.tie_embeddings and pp > 1) or global_batch % (dp * m):
                continue
            out.add((dp, tp, pp))
    return out
