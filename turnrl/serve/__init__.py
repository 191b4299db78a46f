"""HTTP in, engine calls and recorded sessions out: `turnrl serve`.

    app.py            create_app, middleware (token, errors, CORS, HEAD, body limit), ServerThread, run_server
    engine_routes.py  the token-level API (/generate, /update_weights, ...) and the rollout server's /rollout
    chat_routes.py    the chat APIs at the root and per session, the session rule, server-sent events; the APIs
                      are a table of modules:
    openai.py         OpenAI chat completions and legacy text completions
    responses.py      the OpenAI Responses API
    anthropic.py      the Anthropic Messages API
    sessions.py       ChatProxy: sessions, recorded calls, the continuation rule, trajectories
    streaming.py      replies as they are generated: incremental decoding, stop strings, SSE lines
    http.py           what every route shares: JSON bodies, error statuses, model objects
"""

from turnrl.serve.app import ServerThread, create_app, run_server
from turnrl.serve.sessions import ChatProxy

__all__ = ["ChatProxy", "ServerThread", "create_app", "run_server"]
