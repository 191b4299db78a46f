"""reasoning-gym's procedural generators as environments: `--env reasoning_gym:NAME` (`pip install
'turnrl[reasoning-gym]'`; docs/ecosystems.md).

Every generator registered in `reasoning_gym.factory.DATASETS` works, `composite` included (env_config
`datasets: [{name, weight, config}]`). Nothing is downloaded: the tasks are generated on the fly.

    env_config               the episode's settings (the rollout's env_config, the row's `env_config` column over it)
      size, seed             the dataset, as `reasoning_gym.create_dataset(NAME, size=, seed=, ...)` makes it
                             (defaults: reasoning-gym's size 500, seed 0)
      any other key          the generator's own config (`min_terms`, `max_digits`, ...); unknown keys are errors
      system_prompt          the system message (default: reasoning-gym's "default" prompt); null for none
      question_template      the user message, `{question}` standing for the task's question (default: the question)
      feedback               false (default): one answer, scored. true: a wrong answer gets the grader's verdict
                             and another try, up to max_turns
      answer_from            tags (default): the answer is what the reply's last <answer>...</answer> holds
                             (reasoning-gym's own `extract_answer`); reply: the whole reply, stripped (for small
                             models told to "reply with just the answer")
    row `seed`               the task: item `seed` of that dataset (`--limit N` without --data: items 0..N-1)

A reply's answer (`answer_from`, reasoning removed first) is graded by the dataset's own `score_answer` (1.0 exact; some generators give partial credit). The reward is the score of the
last answer, given on the step that ends the episode; every attempt's score is in rollout_infos (`scores`), with
`source_dataset`, `index` and the dataset seed (replay: the same row and config give the same task).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from typing import Any

from turnrl.envs.base import EnvError, EnvFactory, episode_settings
from turnrl.types import Message, StepResult

ADAPTER_KEYS = frozenset({"system_prompt", "question_template", "feedback", "answer_from", "max_turns", "label_key"})
"""env_config keys this adapter reads (or the rollout sets); the others configure the generator."""


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"--env reasoning_gym:... needs the reasoning-gym package ({e}): "
                          "pip install 'turnrl[reasoning-gym]'") from None
    return reasoning_gym


def env_factory(spec: str) -> EnvFactory:
    """The `build_env` of `reasoning_gym:NAME`; an unknown generator fails here, naming close matches."""
    name = spec.partition(":")[2]
    registered = _reasoning_gym().factory.DATASETS
    if name not in registered:
        close = difflib.get_close_matches(name, registered, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"--env {spec}: {name!r} is not a reasoning-gym generator; {hint}{len(registered)} are "
                         f"registered: {', '.join(sorted(registered))}")

    def build_env(sample: dict[str, Any], config: dict[str, Any]) -> ReasoningGymEnv:
        settings = episode_settings(sample, config)
        return ReasoningGymEnv(name, settings, sample.get("seed"))

    build_env.opens_episode = True  # type: ignore[attr-defined]
    build_env.check = functools.partial(dataset, name)  # type: ignore[attr-defined]  # a bad config fails at start
    return build_env


def dataset(name: str, settings: dict[str, Any]) -> Any:
    """The dataset of `name` under `settings` (made once per distinct config: some generators read word lists)."""
    generator = {k: v for k, v in settings.items() if k not in ADAPTER_KEYS}
    generator.setdefault("seed", 0)  # reasoning-gym's default is a random seed: runs would not replay
    return _dataset(name, json.dumps(generator, sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _dataset(name: str, generator_json: str) -> Any:
    rg = _reasoning_gym()
    generator = json.loads(generator_json)
    config_cls = rg.factory.DATASETS[name][1]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(generator) - known)
    if unknown:
        raise ValueError(f"reasoning_gym:{name}: env_config has unknown key(s) {unknown}; the generator's config "
                         f"({config_cls.__name__}) takes {sorted(known)}, and turnrl reads {sorted(ADAPTER_KEYS)}")
    if name == "composite" and isinstance(generator.get("datasets"), list):
        from reasoning_gym.composite import DatasetSpec

        generator["datasets"] = [DatasetSpec(**d) if isinstance(d, dict) else d for d in generator["datasets"]]
    try:
        return rg.create_dataset(name, **generator)
    except (AssertionError, ValueError, TypeError, KeyError) as e:  # reasoning-gym validates with assert
        raise ValueError(f"reasoning_gym:{name}: the generator rejected env_config {json.loads(generator_json)}: "
                         f"{type(e).__name__}: {e}") from None


class ReasoningGymEnv:
    """One task of a reasoning-gym dataset (see the module docstring)."""

    opens_episode = True

    def __init__(self, name: str, settings: dict[str, Any], index: Any):
        if index is None:
            raise EnvError(f"reasoning_gym:{name}: the row has no `seed` (the index of its task in the dataset)")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise EnvError(f"reasoning_gym:{name}: the row's seed must be an integer >= 0, got {index!r:.40}")
        self.name, self.index = name, index
        self.dataset = dataset(name, settings)
        if index >= len(self.dataset):
            raise EnvError(f"reasoning_gym:{name}: row seed {index} is outside the dataset (env_config.size = "
                           f"{len(self.dataset)}): raise size or use seeds below it")
        self.system_prompt = settings.get("system_prompt", _reasoning_gym().utils.SYSTEM_PROMPTS["default"])
        self.question_template = str(settings.get("question_template", "{question}"))
        if "{question}" not in self.question_template:
            raise EnvError(f"reasoning_gym:{name}: env_config.question_template must contain {{question}}")
        self.feedback = bool(settings.get("feedback", False))
        self.answer_from = settings.get("answer_from", "tags")
        if self.answer_from not in ("tags", "reply"):
            raise EnvError(f"reasoning_gym:{name}: env_config.answer_from must be tags or reply, got {self.answer_from!r}")
        self.max_turns = int(settings.get("max_turns") or 1)
        self.entry: dict[str, Any] = {}
        self.scores: list[float] = []

    def reset(self) -> list[Message]:
        self.entry = self.dataset[self.index]
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        question = self.question_template.replace("{question}", self.entry["question"])
        return [*system, {"role": "user", "content": question}]

    def step(self, text: str) -> StepResult:
        from reasoning_gym.utils import extract_answer

        from turnrl.reasoning import split_reasoning

        body = split_reasoning(text)[1]
        answer = extract_answer(body) if self.answer_from == "tags" else (body.strip() or None)
        score = float(self.dataset.score_answer(answer, self.entry))
        self.scores.append(score)
        done = score >= 1.0 or not self.feedback or len(self.scores) >= self.max_turns
        infos = {"scores": list(self.scores), "source_dataset": self.entry["metadata"].get("source_dataset", self.name),
                 "index": self.index, "dataset_seed": self.dataset.seed}
        observation = None if done else self._verdict(answer, score)
        return StepResult(observation, reward=score if done else None, done=done,
                          info={"answer": answer, "score": score}, rollout_infos=infos)

    def _verdict(self, answer: str | None, score: float) -> str:
        if answer is None and self.answer_from == "reply":
            return "Your reply is empty. Try again."
        if answer is None:
            return ("No answer found: put your final answer between <answer> and </answer>. Try again.")
        return f"Your answer {answer!r} is not correct (score {score:.2f} of 1). Try again."
