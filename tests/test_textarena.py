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
    result, _ = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "1", "--env-config", '{"opponent": "self"}')
    assert result.exit_code == 2 and "needs trajectory trees" in " ".join(result.output.split()), result.output
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "[0]")
    result, rows = run(tmp_path, "textarena:TicTacToe-v0", "--limit", "1", "--env-config", '{"num_players": 2}')
    assert result.exit_code == 0, result.output
    assert rows[0]["status"] == "failed" and "needs env_config.opponent" in rows[0]["error"]
