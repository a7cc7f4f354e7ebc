"""Log format selection and the shape of a JSON log line."""

import json
import logging

import structlog

from kvpact.shared.log import configure_logging, resolve_format


def test_format_precedence_argument_then_environment_then_tty():
    assert resolve_format("json", {"KVPACT_LOG_FORMAT": "console"}, isatty=True) == "json"
    assert resolve_format("auto", {"KVPACT_LOG_FORMAT": "console"}, isatty=False) == "console"
    assert resolve_format("auto", {}, isatty=False) == "json"
    assert resolve_format("auto", {}, isatty=True) == "console"


def test_json_lines_carry_bound_context_for_structlog_and_stdlib(capsys):
    configure_logging("json")
    with structlog.contextvars.bound_contextvars(worker_id="w1", request_id="r7"):
        structlog.get_logger("kvpact.test").info("admitted", kind="PAGED")
        logging.getLogger("grpc").warning("foreign line")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["event"] == "admitted" and lines[0]["kind"] == "PAGED"
    assert (lines[0]["worker_id"], lines[0]["request_id"], lines[0]["level"]) == ("w1", "r7", "info")
    assert lines[1]["event"] == "foreign line" and lines[1]["worker_id"] == "w1"


def test_fixed_fields_reach_every_line_foreign_and_other_threads_too(capsys):
    import threading

    configure_logging("json", fields={"worker_id": "w9"})
    thread = threading.Thread(target=lambda: structlog.get_logger("kvpact.engine").warning("step failed"))
    thread.start()
    thread.join()
    ray = logging.getLogger("ray")  # as Ray leaves it once imported: its own handler, no propagation
    ray.addHandler(logging.StreamHandler())
    ray.propagate = False
    configure_logging("json", fields={"worker_id": "w9"})
    ray.warning("ray says hello")
    with structlog.contextvars.bound_contextvars(worker_id="explicit"):
        structlog.get_logger("kvpact.test").info("bound wins")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["event"], line["worker_id"]) for line in lines] == [
        ("step failed", "w9"),
        ("ray says hello", "w9"),
        ("bound wins", "explicit"),
    ]
    configure_logging("json")  # leave no fixed fields for the tests after this one
