"""`turnrl serve`: the token-level endpoint through HttpEngine, authentication, and the per-session OpenAI proxy
driven by unmodified OpenAI-client agents (a scripted engine with the real Qwen3 tokenizer and template)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import openai
import pytest
from fakes import ScriptedEngine
from typer.testing import CliRunner

from turnrl.agents import agent_registry
from turnrl.agents.openai_agent import close_gateways
from turnrl.cli import app as cli_app
from turnrl.config import TrainConfig
from turnrl.engines.base import EngineError, InvalidRequest
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.engines.http import HttpEngine
from turnrl.render import ChatRenderer
from turnrl.rewards import bind_reward
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.serve.app import BindError, ServerThread, check_bind, create_app
from turnrl.serve.openai import chat_completion
from turnrl.serve.sessions import ChatProxy
from turnrl.train.samples import group_advantages
from turnrl.types import RolloutStatus, SamplingParams, SegmentSource, TerminationReason, Trajectory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "openai_agent" / "agent.py"
# Compact JSON, unlike the `tojson` spacing the template would write: a re-render would change these tokens.
TOOL_CALL = '<tool_call>\n{"name":"calculator","arguments":{"expression":"6*7"}}\n</tool_call>'
QUESTION = {"prompt": "What is 6*7?", "answer": 42}


def _example_agent():
    spec = importlib.util.spec_from_file_location("example_openai_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordingEngine(ScriptedEngine):
    """The scripted engine, also keeping every output it returned."""

    def __post_init__(self):
        super().__post_init__()
        self.outputs = []

    async def generate(self, prompt_ids, params, *, request_id, images=None):
        out = await super().generate(prompt_ids, params, request_id=request_id, images=images)
        self.outputs.append(out)
        return out


def calculator_script(request_id: str, turn: int, prompt_text: str) -> str:
    """Call the calculator first; answer once a result is in the conversation."""
    seen_result = "<tool_response>" in prompt_text or "calculator said" in prompt_text
    return "The answer is 42." if seen_result else TOOL_CALL


@pytest.fixture(scope="module", autouse=True)
def _stop_gateways():
    yield
    close_gateways()


@pytest.fixture()
def scripted(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer))
    server = ServerThread(create_app(engine, proxy))
    server.start()
    yield engine, proxy, server.base_url
    server.stop()


# ---- token level -----------------------------------------------------------------------------------
async def test_generate_round_trip_through_http_engine(tiny_qwen3, qwen3_tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    renderer = ChatRenderer(qwen3_tokenizer)
    engine = EmbeddedEngine(tiny_qwen3, eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=4)
    server = ServerThread(create_app(engine, ChatProxy(engine, renderer), model_name="tiny-qwen3"))
    url = server.start()
    try:
        prompt = renderer.initial_ids([{"role": "user", "content": "Name three colours."}])
        greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(151645,))
        direct = await engine.generate(prompt, greedy, request_id="direct")
        remote = HttpEngine(url)
        out = await remote.generate(prompt, greedy, request_id="remote")
        assert out.token_ids == direct.token_ids and out.logprobs == direct.logprobs
        assert out.finish_reason == direct.finish_reason

        state = tiny_qwen3.state_dict()  # tied embeddings: two names, one storage
        assert await remote.update_weights(state, version=5) == 5
        again = await remote.generate(prompt, greedy, request_id="after-update")
        assert again.policy_version == 5 and again.token_ids == direct.token_ids
        from safetensors.torch import save_file

        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
        assert await remote.update_weights_from_path(str(tmp_path), version=6) == 6
        await remote.sleep()
        await remote.wake_up()
        await remote.release("remote")
        health = await remote.health()
        assert health["status"] == "ok" and health["policy_version"] == 6 and health["model"] == "tiny-qwen3"
        with pytest.raises(EngineError, match=r"POST http://127\.0\.0\.1:\d+/generate returned HTTP 422: .*top_p"):
            await remote._request("POST", "/generate", json={"prompt_ids": [1], "request_id": "x",
                                                             "sampling": {"top_p": 0}})
        with pytest.raises(InvalidRequest, match="not a token id") as refused:  # the remote engine's refusal
            await remote.generate([1, 10**7], greedy, request_id="oov")
        assert refused.value.param == "prompt_ids"
        await remote.aclose()
    finally:
        server.stop()
        engine.close()


# ---- authentication --------------------------------------------------------------------------------
def test_non_loopback_bind_needs_a_token(monkeypatch):
    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, None)
    check_bind("0.0.0.0", "s3cret")
    for host in ("0.0.0.0", "192.168.1.5", "example.com"):
        with pytest.raises(BindError, match="--token"):
            check_bind(host, None)
    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    result = CliRunner().invoke(cli_app, ["serve", "--model", "tiny-qwen3", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "refusing to serve" in result.output


async def test_every_request_needs_the_bearer_token(qwen3_tokenizer, monkeypatch):
    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, text: "hi")
    server = ServerThread(create_app(engine, ChatProxy(engine, ChatRenderer(qwen3_tokenizer)), token="s3cret"))
    url = server.start()
    try:
        for token in (None, "wrong"):
            with pytest.raises(EngineError, match="HTTP 401"):
                await HttpEngine(url, token=token).health()
        assert (await HttpEngine(url, token="s3cret").health())["status"] == "ok"
        monkeypatch.setenv("TURNRL_SERVE_TOKEN", "s3cret")  # the client reads the same variable as the server
        out = await HttpEngine(url).generate([1, 2], SamplingParams(max_new_tokens=4), request_id="t")
        assert out.token_ids

        messages = [{"role": "user", "content": "hello"}]
        bad = openai.AsyncOpenAI(base_url=f"{url}/sessions/s/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="m", messages=messages)
        good = openai.AsyncOpenAI(base_url=f"{url}/sessions/s/v1", api_key="s3cret", max_retries=0)
        reply = await good.chat.completions.create(model="m", messages=messages)
        assert reply.choices[0].message.content == "hi"
        assert httpx.get(f"{url}/sessions/s/trajectories").status_code == 401
        assert httpx.get(f"{url}/sessions", headers={"x-api-key": "s3cret"}).status_code == 200  # older Anthropic SDKs
        assert httpx.get(f"{url}/sessions", headers={"x-api-key": "wrong"}).status_code == 401
        refused = httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 4, "messages": messages})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    finally:
        server.stop()


# ---- the OpenAI proxy ------------------------------------------------------------------------------
async def test_openai_tool_loop_records_exact_tokens_and_splits_on_divergence(scripted, qwen3_tokenizer):
    engine, proxy, url = scripted
    base_url = f"{url}/sessions/ep-1/v1"
    agent = _example_agent()
    assert await agent.run(base_url, "any-key", QUESTION) == 1.0  # the unmodified agent: tool call, result, answer

    client = openai.AsyncOpenAI(base_url=base_url, api_key="any-key", max_retries=0)
    diverged = await client.chat.completions.create(  # the agent drops its history
        model="policy", messages=[{"role": "user", "content": "The calculator said 42. Answer?"}], logprobs=True)
    assert [t.logprob for t in diverged.choices[0].logprobs.content] == engine.outputs[2].logprobs

    body = httpx.get(f"{url}/sessions/ep-1/trajectories").json()
    trajectories = [Trajectory.from_json(row) for row in body["trajectories"]]
    assert [t.id for t in trajectories] == ["ep-1", "ep-1.1"]
    assert all(t.episode_id == "ep-1" for t in trajectories)
    assert [c.request_id for c in engine.calls] == ["ep-1"] * 3  # the session id: sticky routing, KV reuse

    main, split = trajectories
    for traj in trajectories:
        traj.validate()
    # the prompt is the template's render; every model segment is exactly what the engine returned
    messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": QUESTION["prompt"]}]
    assert main.prompt_ids == engine.calls[0].prompt_ids == proxy.renderer.initial_ids(messages, agent.TOOLS)
    model = [s for s in main.segments if s.source == SegmentSource.MODEL]
    assert [s.token_ids for s in model] == [o.token_ids for o in engine.outputs[:2]]
    assert [s.logprobs for s in model] == [o.logprobs for o in engine.outputs[:2]]
    assert all(s.loss_mask == [1] * len(s) for s in model)
    # masks: everything injected between the turns is mask 0, tool results tagged as tool
    injected = [s for s in main.segments if s.source != SegmentSource.MODEL]
    assert [s.source for s in injected] == [SegmentSource.TEMPLATE, SegmentSource.TOOL]
    assert all(s.loss_mask == [0] * len(s) for s in injected)
    assert qwen3_tokenizer.decode(injected[0].token_ids) == "\n"  # the template's newline after <|im_end|>
    assert "<tool_response>\n42\n</tool_response>" in qwen3_tokenizer.decode(injected[1].token_ids)
    # append-only: turn 2's prompt was the recorded stream, not a re-render (which respaces the tool call JSON)
    assert engine.calls[1].prompt_ids == main.prompt_ids + main.response_ids[: -len(model[1])]
    history = [{**m, "content": m.get("content") or ""} for m in proxy.session("ep-1").calls[1].messages]
    rerendered = proxy.renderer.initial_ids(history, agent.TOOLS)
    assert rerendered != engine.calls[1].prompt_ids
    assert main.num_turns == 2 and main.termination_reason == TerminationReason.NO_TOOL_CALL
    assert main.messages[-1]["content"] == "The answer is 42."
    # the diverging call started a new trajectory (a new training sample of the same episode)
    assert split.prompt_ids == engine.calls[2].prompt_ids
    assert [(s.source, s.token_ids) for s in split.segments] == [(SegmentSource.MODEL, engine.outputs[2].token_ids)]

    first_reply = proxy.session("ep-1").calls[0].reply
    assert first_reply["content"] is None and first_reply["tool_calls"][0]["function"] == {
        "name": "calculator", "arguments": json.dumps({"expression": "6*7"})}
    assert httpx.delete(f"{url}/sessions/ep-1").json() == {"ok": True, "calls": 3}
    assert engine.released == ["ep-1"]
    assert httpx.get(f"{url}/sessions/ep-1/trajectories").status_code == 404


async def test_chat_requests_the_proxy_cannot_serve_are_refused(scripted):
    _, _, url = scripted
    client = openai.AsyncOpenAI(base_url=f"{url}/sessions/x/v1", api_key="k", max_retries=0)
    hello = [{"role": "user", "content": "hi"}]
    for kwargs, match in [({"n": 2}, "n=2")]:
        with pytest.raises(openai.BadRequestError, match=match):
            await client.chat.completions.create(model="m", messages=hello, **kwargs)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["turnrl"]


async def test_interleaved_conversations_in_one_session_stay_separate(qwen3_tokenizer):
    """Two sub-conversations alternating in one session (no HTTP: the proxy's Python API)."""
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer))
    tools = _example_agent().TOOLS
    conversations = [[{"role": "user", "content": "What is 6*7?"}], [{"role": "user", "content": "And 7*6?"}]]
    for messages in conversations:
        reply = (await chat_completion(proxy, "s", {"messages": messages, "tools": tools}))["choices"][0]["message"]
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "42"}]
    for messages in conversations:
        await chat_completion(proxy, "s", {"messages": messages, "tools": tools})
    first, second = proxy.trajectories("s", group_id="g")
    assert (first.num_turns, second.num_turns, first.group_id) == (2, 2, "g")
    assert "6*7" in qwen3_tokenizer.decode(first.prompt_ids) and "7*6" in qwen3_tokenizer.decode(second.prompt_ids)
    assert [c.base_len is not None for c in proxy.session("s").calls] == [False, False, True, True]


# ---- openai_agent: the same agents inside a rollout --------------------------------------------------
def _manager(engine, tokenizer, agent_spec: str, max_turns: int = 4, reward_fn=None) -> RolloutManager:
    return RolloutManager(engine, ChatRenderer(tokenizer), agents=agent_registry(), default_agent="openai_agent",
                          env_config={"openai_agent": agent_spec}, reward_fn=reward_fn,
                          limits=RolloutLimits(max_turns=max_turns, max_new_tokens=64))


async def test_openai_agent_trains_the_unmodified_example(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    [group] = await run_groups(_manager(engine, qwen3_tokenizer, f"{EXAMPLE}:run"), [{"id": "q", **QUESTION}], n=2)
    assert [t.id for t in group] == ["q-0", "q-1"]
    for traj in group:
        assert (traj.reward, traj.status, traj.num_turns, traj.episode_id) == (1.0, RolloutStatus.COMPLETED,
                                                                                      2, traj.id)
        outputs = [o for c, o in zip(engine.calls, engine.outputs, strict=True) if c.request_id == traj.id]
        model = [s.token_ids for s in traj.segments if s.source == SegmentSource.MODEL]
        assert model == [o.token_ids for o in outputs]
    assert sorted(engine.released) == ["q-0", "q-1"]


async def test_openai_agent_split_episode_shares_one_reward(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    reward = bind_reward(lambda response: float("42" in response))
    spec = f"{ROOT / 'tests' / 'openai_agents.py'}:forgetful_run"  # a synchronous client, returns no reward
    [group] = await run_groups(_manager(engine, qwen3_tokenizer, spec, reward_fn=reward), [{"id": "q", **QUESTION}])
    assert [t.id for t in group] == ["q-0", "q-0.1"]
    assert [t.reward for t in group] == [1.0, 1.0]
    assert {t.episode_id for t in group} == {"q-0"}
    assert [m["role"] for m in group[0].info["trajectory_messages"]] == ["user", "assistant"]  # its own part
    cfg = TrainConfig(model="m", train_data="d")
    pairs, stats = group_advantages([group], cfg)
    assert len(pairs) == 2 and stats["train/trained_trajectories"] == 2.0


async def test_openai_agent_call_beyond_max_turns_ends_the_episode(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    [[traj]] = await run_groups(_manager(engine, qwen3_tokenizer, f"{EXAMPLE}:run", max_turns=1), [QUESTION])
    assert traj.termination_reason == TerminationReason.MAX_TURNS and traj.num_turns == 1
    assert traj.reward is None and len(engine.calls) == 1


async def test_openai_agent_timeout_keeps_the_tokens_generated(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    manager = _manager(engine, qwen3_tokenizer, f"{ROOT / 'tests' / 'openai_agents.py'}:stalling_run")
    manager.limits = RolloutLimits(max_turns=4, max_new_tokens=64, trajectory_timeout_s=1.0)
    [[traj]] = await run_groups(manager, [QUESTION])
    assert (traj.status, traj.termination_reason, traj.num_turns) == (RolloutStatus.FAILED, TerminationReason.TIMEOUT, 1)
    assert traj.response_ids == engine.outputs[0].token_ids


async def test_a_bad_openai_agent_spec_fails_its_trajectory_naming_the_spec(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    rows = [{"id": "colon", **QUESTION, "openai_agent": str(EXAMPLE)},
            {"id": "attr", **QUESTION, "openai_agent": f"{EXAMPLE}:nope"},
            {"id": "file", **QUESTION, "openai_agent": "/nonexistent/agent.py:run"}]
    groups = await run_groups(_manager(engine, qwen3_tokenizer, f"{EXAMPLE}:run"), rows)
    errors = [traj.error for [traj] in groups]
    assert all(traj.status == RolloutStatus.FAILED for [traj] in groups) and not engine.calls
    assert "expected path/file.py:name or package.module:name" in errors[0]
    assert f"{EXAMPLE} has no attribute 'nope'; it defines calculator, run" in errors[1]
    assert "openai agent file /nonexistent/agent.py does not exist" in errors[2]


async def test_openai_agent_runs_the_langgraph_example(qwen3_tokenizer):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    spec = f"{ROOT / 'examples' / 'openai_agent' / 'langgraph_agent.py'}:run"
    [[traj]] = await run_groups(_manager(engine, qwen3_tokenizer, spec), [QUESTION])
    # LangChain echoes the assistant's tool call in its own shape; it still continues the recorded tokens
    assert (traj.reward, traj.num_turns, traj.info["episode_trajectories"]) == (1.0, 2, 1)
    assert [s.source for s in traj.segments] == [SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.TOOL,
                                                 SegmentSource.MODEL]
