"""An OpenEnv-wire server without a WebSocket (tests/test_openenv.py: turnrl falls back to POST /reset and /step).

The wire format is OpenEnv's (`serialize_observation`'s {observation, reward, done}); the env is stateless, as
OpenEnv's own HTTP routes require (they build a fresh env per request)."""

import sys

import uvicorn
from fastapi import FastAPI

app = FastAPI()


@app.get("/schema")
def schema() -> dict:
    action = {"properties": {"metadata": {"type": "object"}, "message": {"type": "string"}}, "required": ["message"]}
    return {"action": action, "observation": {}, "state": {}}


@app.post("/reset")
def reset(body: dict) -> dict:
    return {"observation": {"text": f"Say hello (seed {body.get('seed')})."}, "reward": None, "done": False}


@app.post("/step")
def step(body: dict) -> dict:
    message = body["action"]["message"]
    return {"observation": {"text": f"you said {message}"}, "reward": float("hello" in message.lower()), "done": True}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
