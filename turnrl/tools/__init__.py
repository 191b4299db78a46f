"""Tools the model can call: function tools, stateful tools, tool-call parsers and built-ins.

    function_tool.py   @function_tool, schema inference, ToolResult / ToolResponse, tool errors
    stateful.py        stateful tools (per-trajectory lifecycle), YAML tool configs, ToolSet, ToolSession
    parsers.py         hermes / qwen3_coder tool-call parsers (reasoning stripped, errors for the model)
    calculator.py      calculator (ast, no eval)
    sandbox.py         a sandboxed Python interpreter (python_exec) and the launcher turnrl.agents.sandbox shares;
                       its child program is _sandbox_child.py, the kernel layers _sandbox_kernel.py
"""

from turnrl.tools.calculator import CalculatorError, calculator, evaluate_expression
from turnrl.tools.function_tool import (
    FunctionTool,
    ToolArgumentError,
    ToolError,
    ToolExecutionError,
    ToolLifecycleError,
    ToolResponse,
    ToolResult,
    ToolTimeout,
    check_arguments,
    function_tool,
    infer_schema,
    load_function_tools,
    normalize_result,
)
from turnrl.tools.parsers import (
    PARSERS,
    HermesParser,
    ParseResult,
    Qwen3CoderParser,
    ToolCallParser,
    get_parser,
)
from turnrl.tools.sandbox import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    make_python_tool,
    python_exec,
    run_python_sandboxed,
)
from turnrl.tools.stateful import (
    StatefulTool,
    StatefulToolBase,
    ToolSession,
    ToolSet,
    ToolSpec,
    load_tool_config,
    split_tool_rewards,
)

__all__ = [
    "PARSERS",
    "CalculatorError",
    "FunctionTool",
    "HermesParser",
    "ParseResult",
    "Qwen3CoderParser",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "StatefulTool",
    "StatefulToolBase",
    "ToolArgumentError",
    "ToolCallParser",
    "ToolError",
    "ToolExecutionError",
    "ToolLifecycleError",
    "ToolResponse",
    "ToolResult",
    "ToolSession",
    "ToolSet",
    "ToolSpec",
    "ToolTimeout",
    "calculator",
    "check_arguments",
    "evaluate_expression",
    "function_tool",
    "get_parser",
    "infer_schema",
    "load_function_tools",
    "load_tool_config",
    "make_python_tool",
    "normalize_result",
    "python_exec",
    "run_python_sandboxed",
    "split_tool_rewards",
]
