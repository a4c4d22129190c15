"""The Celery app's configuration, routing and settings (no broker needed)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from producer.broker import app_for_broker, route_task, settings_of
from producer.catalog import CATALOG
from producer.contract import ReusePlan, build_request
from producer.file_backend import BACKEND_PATH
from producer.orders import EVICT_TASK, GENERATE_TASK, MAINTENANCE_QUEUE, WorkOrder, all_queues, queue_for
from workers.app import celery_config, create_app
from workers.settings import WorkerSettings


def order_json(model: str) -> str:
    request = build_request(prompt="a red circle", model=model)
    return WorkOrder(request=request, plan=ReusePlan.full(request.num_steps)).model_dump_json()


def test_delivery_semantics_and_serializer(tmp_path: Path) -> None:
    conf = celery_config(WorkerSettings(state_dir=tmp_path, task_soft_time_limit_s=30, task_time_limit_s=45))
    assert conf["task_acks_late"] is True
    assert conf["task_reject_on_worker_lost"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["task_soft_time_limit"] == 30 and conf["task_time_limit"] == 45
    assert conf["task_serializer"] == conf["result_serializer"] == "json"
    assert conf["accept_content"] == conf["result_accept_content"] == ["json"]
    assert sorted(q.name for q in conf["task_queues"]) == sorted(
        [queue_for(m) for m in CATALOG] + [MAINTENANCE_QUEUE]
    )


def test_empty_broker_url_means_the_filesystem_transport_under_state_dir(tmp_path: Path) -> None:
    conf = celery_config(WorkerSettings(state_dir=tmp_path))
    assert conf["broker_url"] == "filesystem://"
    options = conf["broker_transport_options"]
    assert options["data_folder_in"] == options["data_folder_out"]
    for key in ("data_folder_in", "processed_folder", "control_folder"):
        assert Path(options[key]).is_dir() and Path(options[key]).is_relative_to(tmp_path.resolve())
    assert conf["result_backend"].startswith(f"{BACKEND_PATH}+file://{tmp_path.resolve()}")


def test_redis_broker_keeps_results_in_redis_and_outlasts_the_hard_limit(tmp_path: Path) -> None:
    settings = WorkerSettings(broker_url="redis://127.0.0.1:6379/3", state_dir=tmp_path / "unused")
    conf = celery_config(settings)
    assert conf["broker_url"] == conf["result_backend"] == "redis://127.0.0.1:6379/3"
    assert conf["broker_transport_options"]["visibility_timeout"] > settings.task_time_limit_s
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("model", sorted(CATALOG))
def test_generate_orders_route_to_their_models_queue(model: str) -> None:
    route = route_task(GENERATE_TASK, [order_json(model)], {}, {})
    assert route is not None and route["queue"] == queue_for(model)


@pytest.mark.parametrize("args", [["not json"], [json.dumps({"request": {"model": "nope"}})], []])
def test_unreadable_orders_route_to_maintenance_where_they_are_answered(args: list[str]) -> None:
    route = route_task(GENERATE_TASK, args, {}, {})
    assert route is not None and route["queue"] == MAINTENANCE_QUEUE


def test_evictions_route_to_maintenance_and_other_tasks_are_left_alone() -> None:
    route = route_task(EVICT_TASK, ["{}"], {}, {})
    assert route is not None and route["queue"] == MAINTENANCE_QUEUE
    assert route_task("celery.ping", [], {}, {}) is None


def test_worker_app_registers_both_tasks_and_the_client_app_none(tmp_path: Path) -> None:
    worker_app = create_app(WorkerSettings(state_dir=tmp_path))
    assert {GENERATE_TASK, EVICT_TASK} <= set(worker_app.tasks)
    client = app_for_broker("", state_dir=tmp_path)
    assert GENERATE_TASK not in client.tasks
    assert settings_of(client).state_dir == tmp_path
    assert all_queues()[-1] == MAINTENANCE_QUEUE


def test_the_app_module_and_tasks_import_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys, pathlib\n"
        "from workers.app import create_app\n"
        f"app = create_app(__import__('workers.settings').settings.WorkerSettings(state_dir=pathlib.Path({str(tmp_path)!r})))\n"
        "assert 'chorus.generate' in app.tasks\n"
        "print('torch' in sys.modules, 'diffusers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_worker_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHORUS_WORKER_MODELS", "toy, tiny-random-wan")
    monkeypatch.setenv("CHORUS_WORKER_AUTOSCALE_MAX", "4")
    monkeypatch.setenv("CHORUS_TRAJECTORY_DTYPE", "float16")
    settings = WorkerSettings()
    assert settings.served_models == ["toy", "tiny-random-wan"]
    assert settings.worker_autoscale_max == 4 and settings.trajectory_dtype == "float16"
    monkeypatch.delenv("CHORUS_WORKER_MODELS")
    assert WorkerSettings().served_models == sorted(CATALOG)


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"CHORUS_WORKER_MODELS": "toy,sora"}, "worker_models"),
        (
            {"CHORUS_TASK_SOFT_TIME_LIMIT_S": "100", "CHORUS_TASK_TIME_LIMIT_S": "50"},
            "CHORUS_TASK_TIME_LIMIT_S",
        ),
        (
            {"CHORUS_WORKER_AUTOSCALE_MIN": "5", "CHORUS_WORKER_AUTOSCALE_MAX": "2"},
            "CHORUS_WORKER_AUTOSCALE_MIN",
        ),
        ({"CHORUS_FOLLOWER_POLL_S": "0"}, "follower_poll_s"),
    ],
)
def test_bad_worker_settings_name_the_problem(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], field: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as excinfo:
        WorkerSettings()
    assert field in str(excinfo.value)


def test_worker_command_consumes_its_models_queues_and_sizes_the_pool_from_settings(tmp_path: Path) -> None:
    from workers.cli import worker_argv

    settings = WorkerSettings(
        state_dir=tmp_path,
        worker_models=["toy"],
        worker_concurrency=3,
        worker_autoscale_min=1,
        worker_autoscale_max=5,
    )
    argv, queues, sizing = worker_argv(
        settings, pool="prefork", autoscale=True, hostname="w@h", maintenance=True
    )
    assert queues == [queue_for("toy"), MAINTENANCE_QUEUE]
    assert argv[argv.index("-Q") + 1] == "chorus.toy,chorus.maintenance"
    assert argv[argv.index("--autoscale") + 1] == "5,1" and sizing == "autoscale 1..5"
    argv, queues, sizing = worker_argv(
        settings, pool="prefork", autoscale=False, hostname="w@h", maintenance=False
    )
    assert queues == [queue_for("toy")] and argv[argv.index("--concurrency") + 1] == "3"
    argv, _, _ = worker_argv(settings, pool="solo", autoscale=True, hostname="w@h", maintenance=False)
    assert "--autoscale" not in argv and argv[argv.index("--concurrency") + 1] == "1"


def test_worker_command_refuses_an_unknown_model() -> None:
    from typer.testing import CliRunner

    from producer.cli import app

    result = CliRunner().invoke(app, ["worker", "--model", "sora"])
    # --model takes the catalog's names as choices: typer refuses another and lists them.
    assert result.exit_code == 2 and "'sora' is not one of" in result.output and "'toy'" in result.output


def test_a_filesystem_client_binds_every_queue_before_it_sends(tmp_path: Path) -> None:
    # The transport routes by the exchange table in its control folder; a queue missing there loses messages.
    app_for_broker("", state_dir=tmp_path)
    table = json.loads((tmp_path / "celery" / "control" / "chorus.exchange").read_text())
    assert {queue for _key, _pattern, queue in table} >= set(all_queues())


def test_a_worker_announces_only_the_models_it_can_load(tmp_path: Path) -> None:
    import typer
    from rich.console import Console

    from workers.cli import _servable

    quiet = Console(quiet=True)
    # The default, every catalog model: Wan2.1 without its directory is left out, so its orders are not sent here
    # (they were, and each failed model_unavailable).
    default = _servable(WorkerSettings(state_dir=tmp_path, wan21_dir=None), quiet)
    assert default.served_models == sorted(set(CATALOG) - {"wan2.1-t2v-1.3b"})
    # Named, a model that cannot load stops the worker instead.
    with pytest.raises(typer.Exit) as stopped:
        _servable(
            WorkerSettings(state_dir=tmp_path, worker_models=["wan2.1-t2v-1.3b"], wan21_dir=None), quiet
        )
    assert stopped.value.exit_code == 2
    named = WorkerSettings(state_dir=tmp_path, worker_models=["toy"])
    assert _servable(named, quiet) is named
    # Toy weights that are not there: found before announcing, not by every order failing model_unavailable.
    empty = tmp_path / "no-weights"
    empty.mkdir()
    without = WorkerSettings(state_dir=tmp_path, toy_weights_dir=empty)
    assert "toy" not in _servable(without, quiet).served_models
    loud = Console(record=True, width=300, file=io.StringIO())
    with pytest.raises(typer.Exit) as stopped:
        _servable(without.model_copy(update={"worker_models": ["toy"]}), loud)
    assert stopped.value.exit_code == 2
    said = loud.export_text()
    assert "the toy model's weights are missing" in said and "CHORUS_TOY_WEIGHTS_DIR" in said


def test_a_worker_on_a_device_it_cannot_use_does_not_start() -> None:
    import torch
    from typer.testing import CliRunner

    from producer.cli import app

    if torch.backends.cuda.is_built():
        pytest.skip("this torch is built with CUDA")
    result = CliRunner().invoke(app, ["worker", "--model", "toy"], env={"CHORUS_DEVICE": "cuda"})
    assert result.exit_code == 2
    assert "cannot serve toy: device 'cuda': this torch is built without CUDA" in result.output


def test_the_device_check_counts_gpus_only_where_starting_cuda_is_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from workers.engine.errors import ModelUnavailable
    from workers.engine.registry import check_available, usable_device

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert usable_device("cuda").type == "cuda" and usable_device("cuda:0").index == 0
    with pytest.raises(ModelUnavailable, match="1 CUDA device"):
        usable_device("cuda:3")

    # The worker's main process forks its pool afterwards: counting may start CUDA there, so it is not done.
    def starts_cuda() -> int:
        raise AssertionError("counted GPUs in a process that forks CUDA workers")

    monkeypatch.setattr(torch.cuda, "device_count", starts_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", starts_cuda)
    check_available("toy", device="cuda:3", count_gpus=False)


def test_a_broker_url_no_transport_speaks_is_refused_when_the_config_is_built(tmp_path: Path) -> None:
    from producer.broker import celery_config
    from producer.settings import BrokerSettings, UnusableSetting

    for url in (
        "amqp://guest@h//",
        "REDIS://h:6379/0",
        "redis+socket:///tmp/r.sock",
        "localhost",
        "memory://",
    ):
        celery_config(BrokerSettings(state_dir=tmp_path, broker_url=url))  # as kombu reads them
    with pytest.raises(UnusableSetting, match="no Celery transport for 'garbage://'"):
        celery_config(BrokerSettings(state_dir=tmp_path, broker_url="garbage://u:s3cret@h"))
