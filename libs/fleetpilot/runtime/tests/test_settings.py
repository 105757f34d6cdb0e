"""``ServiceSettings.from_environment``: a service's variables are read strictly, and each
mistake is named in one line (the variable, its value, and the setting it was likely meant for)."""

from __future__ import annotations

from typing import Literal

import pytest
from fleetpilot.runtime import BadSettings, ServiceSettings
from pydantic_settings import SettingsConfigDict


class ExampleSettings(ServiceSettings):
    """A service's settings as every service declares them."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_EXAMPLE_", extra="ignore")

    backend: Literal["sim", "process"] = "sim"
    grace_s: float = 10.0


@pytest.fixture
def environment(monkeypatch):
    for name in [n for n in __import__("os").environ if n.upper().startswith("FLEETPILOT_")]:
        monkeypatch.delenv(name)

    def set_all(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_all


def test_variables_of_the_service_set_its_settings(environment):
    environment({"FLEETPILOT_EXAMPLE_BACKEND": "process", "FLEETPILOT_EXAMPLE_GRACE_S": "2.5",
                 "FLEETPILOT_EXAMPLE_METRICS_PORT": "9300"})
    settings = ExampleSettings.from_environment()
    assert (settings.backend, settings.grace_s, settings.metrics_port) == ("process", 2.5, 9300)


def test_other_services_and_shared_variables_are_not_its_business(environment):
    environment({"FLEETPILOT_OTHER_BAKEND": "x", "FLEETPILOT_NATS_URL": "nats://bus:4222", "FLEETPILOT_DATA": "/d"})
    assert ExampleSettings.from_environment().nats_url == "nats://bus:4222"


@pytest.mark.parametrize(("variables", "message"), [
    ({"FLEETPILOT_EXAMPLE_BAKEND": "process"},
     "FLEETPILOT_EXAMPLE_BAKEND is not a setting (did you mean FLEETPILOT_EXAMPLE_BACKEND?)"),
    ({"fleetpilot_example_grace": "3"},
     "FLEETPILOT_EXAMPLE_GRACE is not a setting (did you mean FLEETPILOT_EXAMPLE_GRACE_S?)"),
    ({"FLEETPILOT_EXAMPLE_WHATEVER": "1"}, "FLEETPILOT_EXAMPLE_WHATEVER is not a setting"),
    ({"FLEETPILOT_EXAMPLE_BACKEND": "k8s"}, "FLEETPILOT_EXAMPLE_BACKEND='k8s': Input should be 'sim' or 'process'"),
    ({"FLEETPILOT_EXAMPLE_GRACE_S": "soon"}, "FLEETPILOT_EXAMPLE_GRACE_S='soon': Input should be a valid number"),
])
def test_a_mistake_is_named_with_its_variable(environment, variables, message):
    environment(variables)
    with pytest.raises(BadSettings) as raised:
        ExampleSettings.from_environment()
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_every_mistake_is_named_at_once(environment):
    environment({"FLEETPILOT_EXAMPLE_BAKEND": "process", "FLEETPILOT_EXAMPLE_GRACE_S": "soon"})
    with pytest.raises(BadSettings) as raised:
        ExampleSettings.from_environment()
    assert "FLEETPILOT_EXAMPLE_BAKEND is not a setting" in str(raised.value)
    assert "FLEETPILOT_EXAMPLE_GRACE_S='soon'" in str(raised.value)


class RulesSettings(ServiceSettings):
    """A service with a structured setting, given as JSON (the policy's shaping rules)."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_EXAMPLE_", extra="ignore")

    rules: list[dict] = []


def test_a_structured_setting_that_is_not_json_is_named_in_one_line(environment):
    # pydantic-settings parses it before validating and raises its own SettingsError, which
    # no caller turned into the one-line error: the service stopped with a traceback.
    environment({"FLEETPILOT_EXAMPLE_RULES": "[{tenant: a}]"})
    with pytest.raises(BadSettings) as raised:
        RulesSettings.from_environment()
    assert str(raised.value).startswith("FLEETPILOT_EXAMPLE_RULES='[{tenant: a}]': ")
    assert "\n" not in str(raised.value)
    environment({"FLEETPILOT_EXAMPLE_RULES": '[{"tenant": "a"}]'})
    assert RulesSettings.from_environment().rules == [{"tenant": "a"}]


def test_the_start_up_limit_is_shared_unless_the_service_sets_its_own(environment):
    assert ExampleSettings.from_environment().startup_timeout_s == 120.0
    environment({"FLEETPILOT_STARTUP_TIMEOUT_S": "30"})
    assert ExampleSettings.from_environment().startup_timeout_s == 30.0
    environment({"FLEETPILOT_EXAMPLE_STARTUP_TIMEOUT_S": "5"})
    assert ExampleSettings.from_environment().startup_timeout_s == 5.0


@pytest.mark.parametrize(("variables", "message"), [
    ({"FLEETPILOT_STARTUP_TIMEOUT_S": "soon"},
     "FLEETPILOT_STARTUP_TIMEOUT_S='soon': Input should be a valid number, unable to parse string as a number"),
    ({"FLEETPILOT_STARTUP_TIMEOUT_S": "0"}, "FLEETPILOT_STARTUP_TIMEOUT_S='0': Input should be greater than 0"),
    ({"FLEETPILOT_STARTUP_TIMEOUT_S": "30", "FLEETPILOT_EXAMPLE_STARTUP_TIMEOUT_S": "-1"},
     "FLEETPILOT_EXAMPLE_STARTUP_TIMEOUT_S='-1': Input should be greater than 0"),
])
def test_a_bad_start_up_limit_is_named_by_the_variable_that_set_it(environment, variables, message):
    # The shared variable is the service's default: naming the service's own variable, which
    # nobody set, would send the operator looking in the wrong place.
    environment(variables)
    with pytest.raises(BadSettings) as raised:
        ExampleSettings.from_environment()
    assert str(raised.value) == message


@pytest.mark.parametrize(("variables", "message"), [
    ({"FLEETPILOT_EXAMPLE_LOG_LEVEL": "verbose"}, "FLEETPILOT_EXAMPLE_LOG_LEVEL='verbose': "),
    ({"FLEETPILOT_LOG_LEVEL": "loud"}, "FLEETPILOT_LOG_LEVEL='loud': "),
    ({"FLEETPILOT_EXAMPLE_METRICS_PORT": "70000"}, "FLEETPILOT_EXAMPLE_METRICS_PORT='70000': "),
    ({"FLEETPILOT_EXAMPLE_METRICS_PORT": "-7"}, "FLEETPILOT_EXAMPLE_METRICS_PORT='-7': "),
])
def test_a_log_level_or_metrics_port_that_cannot_work_is_named_in_one_line(environment, variables, message):
    # Both were taken as they came: an unknown level stopped the service with logging's
    # ValueError traceback before it logged a line; a port past 65535 with an OverflowError
    # traceback once its consumers were already taking work; and a port below -1 turned
    # /metrics and /healthz off without a word (only -1 says so).
    environment(variables)
    with pytest.raises(BadSettings) as raised:
        ExampleSettings.from_environment()
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_a_log_level_in_any_case_and_a_port_of_minus_one_are_still_taken(environment):
    environment({"FLEETPILOT_EXAMPLE_LOG_LEVEL": "debug"})
    assert ExampleSettings.from_environment().log_level == "debug"
    environment({"FLEETPILOT_EXAMPLE_METRICS_PORT": "-1"})
    assert ExampleSettings.from_environment().metrics_port == -1


def test_a_refused_url_is_named_without_its_password(environment):
    # The line goes to the logs: a DSN refused for its scheme printed its password with it.
    class WithStore(ServiceSettings):
        model_config = SettingsConfigDict(env_prefix="FLEETPILOT_EXAMPLE_", extra="ignore")
        store_port: int = 0

    environment({"FLEETPILOT_EXAMPLE_STORE_PORT": "postgresql://fleet:hunter2@db:5432/x"})
    with pytest.raises(BadSettings) as refused:
        WithStore.from_environment()
    assert "hunter2" not in str(refused.value)
    assert "FLEETPILOT_EXAMPLE_STORE_PORT='postgresql://fleet:***@db:5432/x'" in str(refused.value)
