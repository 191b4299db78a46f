"""Check turnrl's SGLangEngine against a running SGLang server (on a GPU machine).

    python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --port 30000 --enable-memory-saver &
    python scripts/check_sglang.py http://localhost:30000 --tokenizer Qwen/Qwen3-0.6B \\
        [--weights /path/to/Qwen3-0.6B --weights-dir /tmp/turnrl-weights] [--sleep]

What it checks (the same `run_checks` runs in tests/test_sglang_engine.py against tests/fake_sglang.py):
1. `/health` answers.
2. Greedy decoding is repeatable (same tokens; logprobs within 0.05, GPU kernels are not bit-exact), and every
   output keeps the invariants: as many logprobs as tokens, each finite and <= 0, at most max_new_tokens.
3. A requested stop token ends the output and is kept in it (`no_stop_trim`), finish_reason stop.
4. max_new_tokens cuts the output with finish_reason length (unless an end-of-turn token came first).
5. A sampled request (temperature 1, seeded) returns valid logprobs.
6. Cancelling a long request returns promptly and the server stays healthy (the adapter sends /abort_request).
7. With --weights and --weights-dir: `update_weights` (the model's own weights, written as safetensors to a
   folder the server reads) returns the requested version, generation reports it, and greedy tokens are
   unchanged. The server must see --weights-dir at the same path.
8. With --sleep: `sleep` / `wake_up` (release/resume memory occupation; needs --enable-memory-saver), then
   (with --weights) reload the weights and generate again.
Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

from turnrl.engines.sglang import SGLangEngine
from turnrl.types import FinishReason, GenerateOutput, SamplingParams


def _check_output(out: GenerateOutput, max_new: int, what: str) -> None:
    assert out.token_ids, f"{what}: no tokens"
    assert len(out.token_ids) == len(out.logprobs), f"{what}: {len(out.token_ids)} tokens, {len(out.logprobs)} logprobs"
    assert len(out.token_ids) <= max_new, f"{what}: {len(out.token_ids)} tokens > max_new_tokens={max_new}"
    bad = [lp for lp in out.logprobs if not (math.isfinite(lp) and lp <= 1e-4)]
    assert not bad, f"{what}: logprobs must be finite and <= 0, got {bad[:5]}"
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), f"{what}: finish {out.finish_reason}"


async def run_checks(base_url: str, prompt_ids: list[int], *, weights: dict[str, Any] | None = None,
                     weights_dir: str | None = None, sleep: bool = False, say=print) -> None:
    engine = SGLangEngine(base_url, weights_dir=weights_dir)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    try:
        assert await engine.health(), f"GET {base_url}/health failed"
        say("ok  health")

        first = await engine.generate(prompt_ids, greedy, request_id="check-greedy-a")
        again = await engine.generate(prompt_ids, greedy, request_id="check-greedy-b")
        _check_output(first, 16, "greedy")
        assert again.token_ids == first.token_ids, f"greedy not repeatable: {first.token_ids} vs {again.token_ids}"
        drift = max(abs(a - b) for a, b in zip(first.logprobs, again.logprobs, strict=True))
        assert drift < 0.05, f"greedy logprobs drift by {drift}"
        say(f"ok  greedy repeatable ({len(first.token_ids)} tokens, finish {first.finish_reason}, drift {drift:.2g})")

        if len(first.token_ids) >= 3:
            stop = first.token_ids[2]
            expected = first.token_ids[: first.token_ids.index(stop) + 1]
            out = await engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=16,
                                                                   stop_token_ids=(stop,)), request_id="check-stop")
            assert out.token_ids == expected and out.finish_reason == FinishReason.STOP, \
                f"stop token {stop}: expected {expected} (stop), got {out.token_ids} ({out.finish_reason})"
            say(f"ok  stop token {stop} kept, finish stop")

        out = await engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=2),
                                    request_id="check-length")
        _check_output(out, 2, "max_new_tokens=2")
        if len(out.token_ids) == 2 and out.token_ids == first.token_ids[:2]:
            assert out.finish_reason == FinishReason.LENGTH, f"max_new_tokens=2: finish {out.finish_reason}"
        say(f"ok  max_new_tokens=2 -> {len(out.token_ids)} tokens, finish {out.finish_reason}")

        out = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
                                    request_id="check-sampled")
        _check_output(out, 16, "sampled")
        say(f"ok  sampled ({len(out.token_ids)} tokens, mean logprob {sum(out.logprobs) / len(out.logprobs):.2f})")

        task = asyncio.ensure_future(engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=4000),
                                                     request_id="check-cancel"))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await engine.health(), "server unhealthy after a cancelled request"
        say("ok  cancelled request aborted, server healthy")

        if weights is not None and weights_dir is not None:
            version = await engine.update_weights(weights, version=7)
            assert version == 7, f"update_weights returned version {version}, expected 7"
            out = await engine.generate(prompt_ids, greedy, request_id="check-after-update")
            assert out.policy_version == 7, f"generation reports policy_version {out.policy_version}, expected 7"
            assert out.token_ids == first.token_ids, "same weights reloaded, but greedy tokens changed"
            say("ok  update_weights from disk: version 7 reported, greedy tokens unchanged")

        if sleep:
            await engine.sleep()
            await engine.wake_up()
            if weights is not None and weights_dir is not None:
                await engine.update_weights(weights, version=8)  # released weights must be reloaded
            out = await engine.generate(prompt_ids, greedy, request_id="check-after-wake")
            _check_output(out, 16, "after wake_up")
            say("ok  sleep / wake_up, then generate")
    finally:
        await engine.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="SGLang server root, e.g. http://localhost:30000")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer (the served model's) for the test prompt")
    parser.add_argument("--weights", help="HF model folder whose *.safetensors are pushed with update_weights")
    parser.add_argument("--weights-dir", help="folder shared with the server, where update_weights writes")
    parser.add_argument("--sleep", action="store_true", help="also check sleep/wake_up (--enable-memory-saver)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 30, comma-separated."}],
                                               add_generation_prompt=True, tokenize=True)
    if isinstance(prompt_ids, dict):
        prompt_ids = prompt_ids["input_ids"]
    weights = None
    if args.weights:
        from pathlib import Path

        from safetensors.torch import load_file

        weights = {}
        for f in sorted(Path(args.weights).glob("*.safetensors")):
            weights.update(load_file(str(f)))
    try:
        asyncio.run(run_checks(args.url, list(prompt_ids), weights=weights, weights_dir=args.weights_dir,
                               sleep=args.sleep))
    except AssertionError as e:
        print(f"FAIL {e}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
