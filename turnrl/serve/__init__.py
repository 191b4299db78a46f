"""HTTP in, engine calls and recorded sessions out: `turnrl serve`.

    app.py         create_app, middleware, run_server, ServerThread; the token-level and chat routes
    sessions.py    ChatProxy: sessions, recorded calls, the continuation rule, trajectories
    chat_apis.py   the OpenAI Responses and Anthropic Messages APIs, SSE streams
"""

from turnrl.serve.app import ServerThread, create_app, run_server
from turnrl.serve.sessions import ChatProxy

__all__ = ["ChatProxy", "ServerThread", "create_app", "run_server"]
