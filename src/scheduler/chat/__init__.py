"""Chat answers beyond text: tool calls and reasoning, put before the model and parsed back."""

from scheduler.chat.split import Markers, Splitter
from scheduler.chat.tools import Reply, Tool, ToolCall, ToolCalling

__all__ = ["Markers", "Reply", "Splitter", "Tool", "ToolCall", "ToolCalling"]
