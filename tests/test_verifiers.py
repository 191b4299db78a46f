"""verifiers v1 traces (message graphs with token deltas, masks and logprobs) as turnrl trajectories, without
re-tokenising. Built with verifiers' own types (`Trace`, `MessageNode`, `Reward`, its `branches`) where the package
is installed (its own venv: it pins mcp==2.0.0 and openai<3); the JSON such a trace dumps is checked in
tests/data/verifiers_trace.json (written by `python tests/test_verifiers.py` there) and converted in every venv."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from turnrl.agents.verifiers import episode_trajectories, trajectories_from_trace
from turnrl.types import BranchKind, Trajectory

DUMP = Path(__file__).resolve().parent / "data" / "verifiers_trace.json"
HAS_VERIFIERS = importlib.util.find_spec("verifiers") is not None


def build_trace(tokenizer):
    """A two-branch episode: the user asks, the model answers in one branch, and in the other calls a tool, gets
    its result and answers; token deltas rendered by the real Qwen3 tokenizer, scaffold unmasked."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Error, Reward, Trace, TraceTask  # noqa: F401
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def node(parent, message, scaffold, body="", sampled=False):
        s, b = enc(scaffold), enc(body)
        n_b = len(b)
        return MessageNode(parent=parent, message=message, sampled=sampled, token_ids=s + b,
                           mask=[False] * len(s) + [sampled] * n_b,
                           logprobs=[-0.1 * (k + 1) for k in range(n_b)] if sampled else [])

    call = ToolCall(id="c1", name="add", arguments='{"a": 2, "b": 2}')
    nodes = [
        node(None, SystemMessage(content="Be terse."), "<|im_start|>system\nBe terse.<|im_end|>\n"),
        node(0, UserMessage(content="2+2?"), "<|im_start|>user\n2+2?<|im_end|>\n"),
        node(1, AssistantMessage(content="4"), "<|im_start|>assistant\n", "4<|im_end|>", sampled=True),
        node(1, AssistantMessage(tool_calls=[call]), "<|im_start|>assistant\n",
             '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>', sampled=True),
        node(3, ToolMessage(tool_call_id="c1", content="4"),
             "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"),
        node(4, AssistantMessage(content="It is 4."), "<|im_start|>assistant\n", "It is 4.<|im_end|>", sampled=True),
    ]
    return Trace(task=TraceTask(type="Sum", data={"idx": 0, "prompt": "2+2?"}), agent=AgentInfo(config={}),
                 nodes=nodes, rewards={"correct": Reward(score=1.0, weight=0.5), "brief": Reward(score=0.4)},
                 metrics={"turns": 2.0}, ok=True, is_completed=True, stop_condition="no_tools")


def check(trajs, dumped):
    assert len(trajs) == 2
    direct, with_tool = trajs
    for traj in trajs:
        traj.validate()
        assert traj.reward == pytest.approx(0.9) and traj.episode_id == dumped["id"]
        assert traj.rollout_infos["rewards"] == {"correct": 1.0, "brief": 0.4}
        assert traj.rollout_infos["metrics"] == {"turns": 2.0}
        assert (traj.status.value, traj.termination_reason.value) == ("completed", "env_done")
    nodes = dumped["nodes"]
    # token-exact: prompt + response is the concatenation of the path's deltas, nothing re-rendered
    assert direct.prompt_ids + direct.response_ids == [t for i in (0, 1, 2) for t in nodes[i]["token_ids"]]
    assert with_tool.prompt_ids + with_tool.response_ids == [t for i in (0, 1, 3, 4, 5) for t in nodes[i]["token_ids"]]
    assert direct.prompt_ids == with_tool.prompt_ids  # the shared prefix, generation prompt included
    assert [s.source.value for s in with_tool.segments] == ["model", "tool", "template", "model"]
    assert with_tool.num_turns == 2 and [m["role"] for m in with_tool.messages] == [
        "system", "user", "assistant", "tool", "assistant"]
    model = [s for s in with_tool.segments if s.source.value == "model"]
    assert [lp for s in model for lp in s.logprobs] == nodes[3]["logprobs"] + nodes[5]["logprobs"]
    assert sum(with_tool.loss_mask) == len(nodes[3]["logprobs"]) + len(nodes[5]["logprobs"])


@pytest.mark.skipif(not HAS_VERIFIERS, reason="verifiers is not installed here (its own venv: pins mcp==2.0.0)")
def test_a_verifiers_trace_and_its_json(qwen3_tokenizer):
    trace = build_trace(qwen3_tokenizer)
    assert [len(b.nodes) for b in trace.branches] == [3, 5]  # verifiers' own branch view
    dumped = trace.model_dump(mode="json")
    check(trajectories_from_trace(trace, group_id="g"), dumped)
    check(trajectories_from_trace(dumped, group_id="g"), dumped)
    def shape(nodes):  # what the conversion reads (timestamps differ)
        return [(n["parent"], n["message"], n["token_ids"], n["mask"], n["logprobs"]) for n in nodes]

    assert shape(json.loads(DUMP.read_text())["nodes"]) == shape(dumped["nodes"]), \
        "regenerate: python tests/test_verifiers.py"


def test_the_json_verifiers_dumps():
    dumped = json.loads(DUMP.read_text())
    check(trajectories_from_trace(dumped, group_id="g"), dumped)


def test_a_failed_rollout_and_bad_nodes():
    dumped = json.loads(DUMP.read_text())
    failed = {**dumped, "ok": False, "errors": [{"type": "HarnessError", "message": "the program exited 1"}]}
    for traj in trajectories_from_trace(failed, group_id="g"):
        assert traj.status.value == "failed" and traj.error == "verifiers: HarnessError: the program exited 1"
    broken = json.loads(json.dumps(dumped))
    broken["nodes"][2]["logprobs"] = broken["nodes"][2]["logprobs"][:-1]
    with pytest.raises(ValueError, match=r"sampled tokens but \d+ logprobs"):
        trajectories_from_trace(broken, group_id="g")


def _ctx():
    from types import SimpleNamespace

    def failed(reason, error):
        traj = Trajectory(id="q-0", group_id="q", sample_index=0, prompt_ids=[])
        traj.finish(reason, error)
        return traj

    return SimpleNamespace(trajectory_id="q-0", group_id="q", sample_index=0, agent_name="verifiers", failed=failed)


def _recorded(dumped, version=3):
    """What turnrl's session recorded for the dump's sampled nodes (their masked tokens), with the engine's own
    logprobs (shifted here, so the test sees which ones the trajectory took)."""
    from types import SimpleNamespace

    calls = []
    for node in dumped["nodes"]:
        ids = [t for t, m in zip(node["token_ids"], node["mask"], strict=True) if m]
        if ids:
            calls.append(SimpleNamespace(completion_ids=ids, logprobs=[lp - 0.5 for lp in node["logprobs"]],
                                         policy_version=version))
    return calls


def test_an_episode_becomes_trajectories_checked_against_the_recorded_calls():
    dumped = json.loads(DUMP.read_text())
    episode = {"id": "ep-1", "traces": [dumped]}
    trajs = episode_trajectories(_ctx(), {"idx": 0}, episode, _recorded(dumped))
    assert [t.id for t in trajs] == ["q-0", "q-0.1"] and {t.episode_id for t in trajs} == {"q-0"}
    first, second = trajs  # the trace's second branch forks its first, under the episode's ids
    assert first.parent is None and (second.parent.id, second.parent.kind) == ("q-0", BranchKind.FORK)
    assert first.stream[: second.parent.at] == second.stream[: second.parent.at]
    for traj in trajs:
        traj.validate()
        assert traj.status.value == "completed" and traj.agent == "verifiers"
        assert traj.rollout_infos["verifiers_episode_id"] == "ep-1"
        model = [s for s in traj.segments if s.source.value == "model"]
        assert {s.policy_version for s in model} == {3}  # the engine's version, from the recorded call
        recorded = {tuple(c.completion_ids): c.logprobs for c in _recorded(dumped)}
        assert [s.logprobs for s in model] == [recorded[tuple(s.token_ids)] for s in model]  # the engine's
    # a trace claiming tokens the engine never returned to the session fails that trajectory
    forged = _recorded(dumped)[:-1]
    bad = episode_trajectories(_ctx(), {}, episode, forged)
    assert bad[0].status.value == "completed"
    assert bad[1].status.value == "failed" and "not what turnrl's engine returned" in bad[1].error
    # a harness that failed because the session refused a call past max_turns ends as max_turns
    failed = {**dumped, "ok": False, "errors": [{"type": "ProviderError", "message": "turn_limit"}]}
    capped = episode_trajectories(_ctx(), {}, {"id": "e", "traces": [failed]}, _recorded(dumped), max_turns_hit=True)
    assert {t.termination_reason.value for t in capped} == {"max_turns"} and capped[0].error is None
    assert "rollout.max_turns" in capped[0].warnings[0]
    # an episode without a trace (its setup failed) is one failed trajectory with its error
    [none] = episode_trajectories(_ctx(), {}, {"id": "e", "traces": [], "errors": [
        {"type": "SandboxError", "message": "uv sync failed"}]}, [])
    assert none.status.value == "failed" and none.error == "verifiers: SandboxError: uv sync failed"


# ---- verifiers' own client code against turnrl's side of the protocol (its venv: make verifiers-test) --------
@pytest.mark.skipif(not HAS_VERIFIERS, reason="verifiers is not installed here (its own venv: pins mcp==2.0.0)")
async def test_the_renderers_train_client_generates_through_turnrl(qwen3_tokenizer):
    """What a verifiers env server's train client does each turn (`renderers.client.generate`: render with its own
    Qwen3 renderer, POST the ids, parse the answer), against turnrl's /inference/v1/generate."""
    from fakes import ScriptedEngine
    from openai import AsyncOpenAI
    from renderers import Qwen3RendererConfig, create_renderer
    from renderers.base import load_tokenizer
    from renderers.client import generate

    from turnrl.render import ChatRenderer
    from turnrl.serve.app import ServerThread, create_app
    from turnrl.serve.sessions import ChatProxy

    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, text: "<reversed_text>olleh</reversed_text>")
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer))
    server = ServerThread(create_app(engine, proxy, model_name="pol"))
    url = server.start()
    try:
        renderer = create_renderer(load_tokenizer(qwen3_tokenizer.name_or_path), Qwen3RendererConfig())
        client = AsyncOpenAI(base_url=f"{url}/sessions/trace-7/v1", api_key="none")
        messages = [{"role": "system", "content": "Reverse it."}, {"role": "user", "content": "hello"}]
        result = await generate(client=client, renderer=renderer, messages=messages, model="pol",
                                sampling_params={"temperature": 0.8, "top_p": 0.95, "max_tokens": 40})
        await client.close()
    finally:
        server.stop()
    im_end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = qwen3_tokenizer.encode("<reversed_text>olleh</reversed_text>", add_special_tokens=False) + [im_end]
    assert result["completion_ids"] == reply and result["finish_reason"] == "stop"
    assert result["completion_logprobs"] == [-(k + 1) / 100 for k in range(len(reply))]
    assert result["content"] == "<reversed_text>olleh</reversed_text>"
    [call] = proxy.session("trace-7").calls  # recorded in the session the base_url names, exactly as sent
    assert call.prompt_ids == result["prompt_ids"] and call.completion_ids == reply
    params = engine.calls[0].params
    assert (params.temperature, params.top_p, params.max_new_tokens) == (0.8, 0.95, 40)
    assert im_end in params.stop_token_ids


@pytest.mark.skipif(not HAS_VERIFIERS, reason="verifiers is not installed here (its own venv: pins mcp==2.0.0)")
async def test_turnrls_episode_assembly_matches_verifiers(qwen3_tokenizer):
    """A trace growing turn by turn, streamed by verifiers' own DeltaStreamer: turnrl's assembly of the deltas
    (turnrl.agents.verifiers_wire, no verifiers needed) is verifiers' EpisodeAssembly's."""
    from verifiers.v1.serve.delta import DeltaStreamer, TraceSummary, pack
    from verifiers.v1.serve.delta import EpisodeAssembly as Theirs

    from turnrl.agents.verifiers_wire import EpisodeAssembly, unpack

    full = build_trace(qwen3_tokenizer)
    nodes, rewards = list(full.nodes), dict(full.rewards)
    trace = full.model_copy(update={"nodes": [], "rewards": {}})
    frames: list[bytes] = []

    async def send(delta):
        frames.append(pack(delta))

    streamer = DeltaStreamer(lambda: [trace], send)
    for node in nodes:  # one turn at a time, as the rollout appends them
        trace.nodes.append(node)
        await streamer.flush()
    trace.rewards = rewards
    await streamer.flush()
    ours, theirs = EpisodeAssembly(), Theirs()
    for frame in frames:
        ours.apply(unpack(frame))
        theirs.apply(unpack(frame))
    summary = [TraceSummary(id=trace.id, nodes=len(nodes), calls=0)]
    head = {"id": "ep", "errors": []}
    assert ours.finish(head, [s.model_dump() for s in summary]) == theirs.finish(head, summary)
    assert len(frames) == len(nodes) + 1


if __name__ == "__main__":  # writes the JSON dump (in a venv with verifiers)
    from turnrl.models import load_tokenizer

    DUMP.write_text(json.dumps(build_trace(load_tokenizer("tiny-qwen3")).model_dump(mode="json"), indent=1) + "\n")
    print(f"wrote {DUMP}")
