"""`--env textarena:GAME-v0` through the public CLI: TextArena's own games (single-player, and two-player with a
scripted opponent in the other seat), game rewards per player, masks, rows without prompt, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.config import TrainConfig
from turnrl.train.samples import group_advantages
from turnrl.types import Trajectory

pytest.importorskip("textarena", reason="pip install 'turnrl[textarena]'")
runner = CliRunner()
OPPONENT = Path(__file__).resolve().parent / "data" / "ta_opponent.py"


def run(tmp_path, env, *flags):
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--env", env, "--out", str(out),
                                 "--max-new-tokens", "32", "--reward", "env", *flags])
    return result, ([json.loads(line) for line in out.read_text().splitlines()] if out.exists() else [])


def check(row):
    Trajectory.from_json(row).validate()
    for seg in row["segments"]:
        mask = row["loss_mask"][seg["start"]: seg["start"] + seg["length"]]
        assert set(mask) == ({1} if seg["source"] == "model" else {0}), seg


def binary_search(rid, turn, prompt):
    """Guess The Number by bisection, reading TextArena's hints from the conversation."""
    low, high = 1, 20
    for guess, hint in re.findall(r"\[Player\] \[(\d+)\]\s*\[GAME\] The target number is (lower|higher)", prompt):
        low, high = (low, int(guess) - 1) if hint == "lower" else (int(guess) + 1, high)
    return f"[{(low + high) // 2}]"


def test_single_player_game_to_the_win(tmp_path, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, binary_search)
    result, rows = run(tmp_path, "textarena:GuessTheNumber-v0", "--limit", "3", "--n", "2", "--max-turns", "10")
    assert result.exit_code == 0, result.output
    assert len(rows) == 6
    for row in rows:
        check(row)
        assert (row["status"], row["termination_reason"]) == ("completed", "env_done"), row["error"]
        assert row["reward"] == 1.0 and row["rollout_infos"]["game_rewards"] == {"0": 1.0}
        assert row["rollout_infos"]["game_info"]["0"]["reason"].startswith("Congratulations")
        assert row["messages"][0]["content"].startswith("[GAME] You are Player 0. You are playing Guess The Number")
        if row["num_turns"] > 1:  # each later message is only what the game added, never the transcript again
            assert row["messages"][2]["content"].startswith("[Player] [10]")
            assert "You are playing" not in row["messages"][2]["content"]
    by_group = {}
    for row in rows:  # the two samples of a row play the same game (its seed)
        by_group.setdefault(row["group_id"], set()).add(tuple(m["content"] for m in row["messages"]))
    assert all(len(games) == 1 for games in by_group.values())


def test_single_player_game_lost(tmp_path, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "[1]" if "lower" not in prompt else "[2]")
    result, rows = run(tmp_path, "textarena:GuessTheNumber-v0", "--limit", "1", "--max-turns", "12",
                       "--env-config", '{"system_prompt": "Play well."}')
    assert result.exit_code == 0, result.output
    [row] = rows
    check(row)
    assert row["messages"][0] == {"role": "system", "content": "Play well."}
    assert row["termination_reason"] == "env_done" and row["reward"] < 1.0, row["rollout_infos"]


def test_two_players_against_a_scripted_opponent(tmp_path, monkeypatch, qwen3_tokenizer):
    def policy(rid, turn, prompt):
        moves = re.findall(r"'(\[\d+\])'", prompt.rsplit("Available Moves:", 1)[-1])
        return moves[-1]  # the last available cell; the opponent takes the first

    script_the_cli(monkeypatch, qwen3_tokenizer, policy)
    config = {"opponent": f"{OPPONENT}:first_available", "seat": 1}
    result, rows = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "2", "--max-turns", "9",
                       "--env-config", json.dumps(config))
    assert result.exit_code == 0, result.output
    for row in rows:
        check(row)
        infos = row["rollout_infos"]
        assert infos["seat"] == 1 and set(infos["game_rewards"]) == {"0", "1"}
        assert row["reward"] == infos["game_rewards"]["1"]
        assert sorted(infos["game_rewards"].values()) in ([-1.0, 1.0], [0.0, 0.0])
        assert "As Player 1" in row["messages"][0]["content"]


def test_errors(tmp_path, monkeypatch, qwen3_tokenizer):
    result, _ = run(tmp_path, "textarena:GuessTheNumbr-v0", "--limit", "1")
    assert result.exit_code == 2 and "did you mean GuessTheNumber-v0" in result.output, result.output
    result, _ = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "1", "--env-config",
                    '{"opponent": "self", "seat": 1}')
    assert result.exit_code == 2 and "has no meaning with opponent: self" in " ".join(result.output.split())
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "[0]")
    result, rows = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "1", "--env-config", '{"num_players": 2}')
    assert result.exit_code == 0, result.output
    assert rows[0]["status"] == "failed" and "needs env_config.opponent" in rows[0]["error"]


def cells(prompt):
    return re.findall(r"'(\[\d+\])'", prompt.rsplit("Available Moves:", 1)[-1])


def test_self_play_every_seat_a_branch_of_one_episode(tmp_path, monkeypatch, qwen3_tokenizer):
    """opponent: self: the policy plays both seats of a real TicTacToe game; each seat's turns are a trajectory of
    their own in one episode (seat 1's a `seat` branch of seat 0's), each with its own observations and reward."""
    asked = []

    def policy(rid, turn, prompt):
        asked.append(rid)
        moves = cells(prompt)  # seat 0 takes the first free cell, seat 1 the last: seat 0 wins along the top row
        return (moves[0] if ".s1" not in rid else moves[-1]) if moves else "[0]"

    script_the_cli(monkeypatch, qwen3_tokenizer, policy)
    result, rows = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "2", "--n", "2", "--max-turns", "9",
                       "--env-config", '{"opponent": "self", "system_prompt": "Win."}')
    assert result.exit_code == 0, result.output
    assert len(rows) == 8  # 2 rows x 2 samples x 2 seats
    by_episode = {}
    for row in rows:
        check(row)
        by_episode.setdefault(row["episode_id"], {})[row["rollout_infos"]["seat"]] = row
    assert len(by_episode) == 4
    for episode_id, seats in by_episode.items():
        first, second = seats[0], seats[1]
        assert first["id"] == episode_id and second["id"] == f"{episode_id}.s1"
        assert first["parent"] is None
        assert second["parent"]["id"] == episode_id and second["parent"]["kind"] == "seat"
        at = second["parent"]["at"]  # the streams share the chat template's start and the system prompt, no more
        stream = lambda r: r["prompt_ids"] + r["response_ids"]  # noqa: E731
        assert 0 < at < len(first["prompt_ids"]) and stream(first)[:at] == stream(second)[:at]
        assert stream(first)[at] != stream(second)[at]
        for seat, row in seats.items():
            assert (row["status"], row["termination_reason"]) == ("completed", "env_done"), row["error"]
            assert row["messages"][0] == {"role": "system", "content": "Win."}
            assert f"You are Player {seat}" in row["messages"][1]["content"]
            assert row["group_id"] == first["group_id"] and row["sample_index"] == first["sample_index"]
        rewards = first["rollout_infos"]["game_rewards"]
        assert rewards == second["rollout_infos"]["game_rewards"] == {"0": 1.0, "1": -1.0}
        assert (first["reward"], second["reward"]) == (1.0, -1.0)
        assert first["turn_rewards"] == [1.0] and second["turn_rewards"] == [-1.0]
        # each seat's moves are its own model turns (mask 1); the other seat's moves reach it as observations (0)
        assert first["num_turns"] == 3 and second["num_turns"] == 2
        moves = [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in (first, second)]
        assert moves == [["[0]", "[1]", "[2]"], ["[8]", "[7]"]], moves  # seat 0 wins along the top row
        for row, mine, theirs in ((first, moves[0], moves[1]), (second, moves[1], moves[0])):
            other = 1 - row["rollout_infos"]["seat"]
            observed = "\n".join(m["content"] for m in row["messages"] if m["role"] == "user")
            # the other seat's moves it saw before its own last one (the game ended on seat 0's third)
            assert all(f"[Player {other}] {move}" in observed for move in theirs[: len(mine) if other else 2])
            trained = qwen3_tokenizer.decode([t for t, m in zip(row["response_ids"], row["loss_mask"],
                                                                strict=True) if m])
            assert re.findall(r"\[\d\]", trained) == mine  # mask 1: this seat's own moves, nothing else
    # the engine was asked for each seat's turns under that seat's own trajectory id
    assert {rid.endswith(".s1") for rid in asked} == {True, False}


def test_self_play_seat_that_stops_early_stops_the_game(tmp_path, monkeypatch, qwen3_tokenizer):
    """A seat whose trajectory ends before the game (here max_turns) stops the game: the other seat, waiting for its
    turn, fails with a message naming it, never hangs; an unfinished game gives no seat a game reward."""
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: cells(prompt)[0])
    result, rows = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "1", "--max-turns", "2",
                       "--env-config", '{"opponent": "self"}')
    assert result.exit_code == 0, result.output
    first, second = sorted(rows, key=lambda r: r["id"])
    assert second["parent"]["kind"] == "seat" and first["episode_id"] == second["episode_id"] == first["id"]
    assert (first["status"], first["termination_reason"]) == ("completed", "max_turns")
    assert (second["status"], second["termination_reason"]) == ("failed", "env_error")
    assert "seat 0's trajectory ended before the game did" in second["error"]
    assert first["turn_rewards"] == [] and "game_rewards" not in first["rollout_infos"]


def test_self_play_advantages_count_the_episode_once(tmp_path, monkeypatch, qwen3_tokenizer):
    """Two games of one row: seat 0 wins the first, seat 1 the second. Each game counts once in the group (with the
    last seat's reward), each seat is scored against that baseline with its own reward: the winners +, the losers -."""
    def policy(rid, turn, prompt):
        moves = cells(prompt)
        if rid.endswith("-1"):  # game 2, seat 0: cells 1, 3, 5, 7 (no line); seat 1 takes 0, 2, 4, 6 and wins
            return next(m for m in ("[1]", "[3]", "[5]", "[7]") if m in moves)
        return moves[0] if ".s1" not in rid else moves[-1]

    script_the_cli(monkeypatch, qwen3_tokenizer, policy)
    result, rows = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "1", "--n", "2", "--max-turns", "9",
                       "--env-config", '{"opponent": "self"}')
    assert result.exit_code == 0, result.output
    group = sorted((Trajectory.from_json(row) for row in rows), key=lambda t: (t.sample_index, t.id))
    assert {t.id.split("-")[-1]: t.reward for t in group} == {"0": 1.0, "0.s1": -1.0, "1": -1.0, "1.s1": 1.0}
    scored, stats = group_advantages([group], TrainConfig(model="tiny-qwen3", train_data="x"))
    adv = {t.id.split("-")[-1]: a for t, a in scored}
    # episode rewards (seat 1's): [-1, 1], std 1.414; seat 0 of game 1: -0.7071 + (1 - -1) / 1.414 = +0.7071
    assert adv == pytest.approx({"0": 0.7071, "0.s1": -0.7071, "1": -0.7071, "1.s1": 0.7071}, abs=1e-4)
    assert stats["train/trained_trajectories"] == 4.0 and stats["train/mean_group_size"] == 2.0  # 2 games, not 4
