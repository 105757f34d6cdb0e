"""The executor library: backends that run tasks, idempotent dispatch, business hooks.

- :class:`ExecutorBackend` with :class:`ProcessBackend` (real OS processes) and
  :class:`SimBackend` (in-process state, simulator hook);
- :func:`execute_decision` with an :class:`ExecutionJournal` (each decision once);
- :class:`BusinessContextProvider`, :class:`LifecycleHook` and the shipped
  :class:`PreDecommissionHook`, guarded by a :class:`HookLock` with a time-to-live.
"""

from .backend import STARTED_OVER, BackendError, ExecutorBackend, ProcessSample, TaskHandle, resumes
from .business import (
    ALLOW,
    BusinessContextProvider,
    GpuContext,
    HookVerdict,
    LifecycleHook,
    StaticBusinessContext,
    check_before_assign,
    check_pre_decommission,
    notify_after_finish,
)
from .decommission import (
    Command,
    Cordon,
    Decommission,
    DecommissionRules,
    GpuDecommission,
    PreDecommissionHook,
    step,
)
from .dispatch import action_id_for, carried_out_on, execute_decision
from .journal import ActionResult, ExecutionJournal, InMemoryExecutionJournal, recorded_result
from .locks import Clock, HookLock, InMemoryHookLock
from .process import ProcessBackend, classify_exit
from .sim import SimAdapter, SimBackend

__all__ = [
    "ALLOW",
    "STARTED_OVER",
    "ActionResult",
    "BackendError",
    "BusinessContextProvider",
    "Clock",
    "Command",
    "Cordon",
    "Decommission",
    "DecommissionRules",
    "ExecutionJournal",
    "ExecutorBackend",
    "GpuContext",
    "GpuDecommission",
    "HookLock",
    "HookVerdict",
    "InMemoryExecutionJournal",
    "InMemoryHookLock",
    "LifecycleHook",
    "PreDecommissionHook",
    "ProcessBackend",
    "ProcessSample",
    "SimAdapter",
    "SimBackend",
    "StaticBusinessContext",
    "TaskHandle",
    "action_id_for",
    "carried_out_on",
    "check_before_assign",
    "check_pre_decommission",
    "classify_exit",
    "execute_decision",
    "notify_after_finish",
    "recorded_result",
    "resumes",
    "step",
]
