"""The optional ``lmcache_platform_doctor`` hook, and doctor's selection messages (issue 14, item 9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import lmcache_platform as lp
from lmcache_platform import Availability, DoctorFinding, hookimpl, hookspecs
from lmcache_platform._cli import doctor
from lmcache_platform_cpu import _doctor as cpu_doctor
from support.fakes import backend as fake


def backend(device: str = "cpu", doctor_hook=None, **kw):
    plugin = fake(device, **kw)
    if doctor_hook is not None:
        plugin.lmcache_platform_doctor = hookimpl(doctor_hook)
    return plugin


def hint_messages(report) -> list[str]:
    return [f"{h['level']}: {h['message']}" for h in report["hints"]]


def test_the_hook_is_a_known_optional_spec(lmcache_registry):
    assert callable(hookspecs.lmcache_platform_doctor)
    lp.register_backend(backend(doctor_hook=lambda device_type: None), "cpu")  # validated: no unknown hook
    assert lp.selected_backend("cpu").status is lp.Status.OK


def test_only_the_selected_backend_is_asked_and_its_lines_are_shown(lmcache_registry):
    asked: list[tuple[str, str]] = []

    def hook_of(name: str):
        def lmcache_platform_doctor(device_type: str):
            asked.append((name, device_type))
            return [
                DoctorFinding.info(f"{name} keeps KV caches in RAM"),
                DoctorFinding.warning(f"{name} has 3 GiB left"),
            ]

        return lmcache_platform_doctor

    lmcache_registry.install("cpu", backend(doctor_hook=hook_of("cpu")))
    lmcache_registry.install("cpu.file", backend(doctor_hook=hook_of("cpu.file")))
    report = doctor.collect()
    assert asked == [("cpu", "cpu")]
    assert report["findings"] == [
        {"backend": "cpu", "device_type": "cpu", "level": "info", "message": "cpu keeps KV caches in RAM"},
        {"backend": "cpu", "device_type": "cpu", "level": "warning", "message": "cpu has 3 GiB left"},
    ]
    assert "warning: cpu: cpu has 3 GiB left" in hint_messages(report)
    text = doctor.format_text(report)
    assert "\ncpu       cpu keeps KV caches in RAM\n" in text and "warning   cpu: cpu has 3 GiB left" in text


def test_an_error_finding_fails_doctor(lmcache_registry):
    lmcache_registry.install("cpu", backend(doctor_hook=lambda: [DoctorFinding.error("no room at all")]))
    report = doctor.collect()
    assert report["ok"] is False and "error: cpu: no room at all" in hint_messages(report)


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (RuntimeError("driver query crashed"), "RuntimeError: driver query crashed"),
        (["a plain string"], "returned 'a plain string', not a DoctorFinding"),
        (42, "TypeError"),
    ],
)
def test_a_broken_hook_is_a_warning_not_a_crash(lmcache_registry, answer, needle):
    def lmcache_platform_doctor(device_type: str):
        if isinstance(answer, Exception):
            raise answer
        return answer

    lmcache_registry.install("cpu", backend(doctor_hook=lmcache_platform_doctor))
    report = doctor.collect()
    (finding,) = report["findings"]
    assert finding["level"] == "warning" and finding["backend"] == "cpu"
    assert (
        finding["message"].startswith("its lmcache_platform_doctor hook failed: ")
        and needle in finding["message"]
    )
    assert report["ok"] is True


def test_ambiguity_is_reported_as_ambiguity(lmcache_registry):
    lmcache_registry.install("cpu.fast", backend())
    lmcache_registry.install("cpu.file", backend())
    messages = hint_messages(doctor.collect())
    assert (
        "error: cpu is ambiguous: cpu.fast, cpu.file can all serve it and none is the primary backend "
        "'cpu'; choose one with LMCACHE_PLATFORM_BACKEND=cpu.fast (the same for engine and server)"
    ) in messages
    assert not [m for m in messages if "no usable backend" in m]


def test_nothing_usable_is_reported_with_the_reasons(lmcache_registry):
    lmcache_registry.install("cpu", backend(probe=Availability.no("/dev/shm is missing")))
    messages = hint_messages(doctor.collect())
    assert "error: no usable backend serves cpu on this host (cpu: /dev/shm is missing)" in messages


@pytest.mark.parametrize(("level", "message"), [("fatal", "x"), ("info", ""), ("info", "two\nlines")])
def test_a_finding_is_one_line_at_a_known_level(level, message):
    with pytest.raises(ValueError, match="DoctorFinding"):
        DoctorFinding(level, message)


# -- the cpu backend's hook: /dev/shm only when it exports through /dev/shm -----------------


def test_cpu_reports_memfd_and_never_dev_shm_room_by_default(monkeypatch):
    monkeypatch.delenv("LMCACHE_PLATFORM_CPU_IPC", raising=False)
    (finding,) = cpu_doctor.findings()
    assert finding.level == "info" and "sealed memfds" in finding.message


def test_cpu_shm_kind_reports_the_room_in_dev_shm(monkeypatch):
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", "shm")
    st = os.statvfs("/dev/shm")
    info = cpu_doctor.findings()[0]
    assert info.level == "info" and f"free of {lp.format_bytes(st.f_blocks * st.f_frsize)}" in info.message


def test_cpu_shm_kind_says_how_to_fix_a_missing_dir(tmp_path):
    (finding,) = cpu_doctor.shm_findings(str(tmp_path / "absent"))
    assert finding.level == "warning" and "is not usable (No such file or directory)" in finding.message
    assert "--shm-size" in finding.message and "LMCACHE_PLATFORM_CPU_IPC" in finding.message


def test_doctor_in_a_fresh_process_shows_the_cpu_backends_lines():
    code = "import sys; from lmcache_platform._cli import main; sys.exit(main(['doctor', '--json']))"
    for kind, needle in (("shm", "/dev/shm segments"), ("memfd", "sealed memfds")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_PLATFORM_")}
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=False,
            env={**env, "LMCACHE_PLATFORM_CPU_IPC": kind},
        )
        report = json.loads(proc.stdout)
        assert report["schema"] == 2 and "shm" not in report
        assert [f["backend"] for f in report["findings"] if needle in f["message"]] == ["cpu"], kind


def test_doctor_shows_cpu_file_lines_only_when_it_is_selected(tmp_path):
    kv = tmp_path / "kv"
    code = "import sys; from lmcache_platform._cli import main; sys.exit(main(['doctor', '--json']))"
    base = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_PLATFORM_")}
    for chosen in ("cpu.file", ""):
        env = {**base, "LMCACHE_PLATFORM_CPU_FILE_DIR": str(kv), "LMCACHE_PLATFORM_BACKEND": chosen}
        report = json.loads(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
            ).stdout
        )
        mine = [f["message"] for f in report["findings"] if f["backend"] == "cpu.file"]
        assert [m.startswith(f"KV files in {kv}: ") for m in mine] == ([True] if chosen else []), chosen


def test_an_unusable_explicit_choice_is_reported_as_that_choice(lmcache_registry):
    """Not "no usable backend serves cpu" while cpu is ok: what was chosen, its state, why, what to do."""
    lmcache_registry.install("cpu", backend())
    lmcache_registry.install("cpu.hugetlb", backend(probe=Availability.no("vm.nr_hugepages is 0")))
    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.hugetlb")
    report = doctor.collect()
    messages = hint_messages(report)
    assert not [m for m in messages if "no usable backend" in m]
    (hint,) = [m for m in messages if "cpu.hugetlb" in m]
    assert hint.startswith(
        "error: LMCACHE_PLATFORM_BACKEND chooses 'cpu.hugetlb' for device type 'cpu', but it cannot serve: "
        "'cpu.hugetlb' is registered but unavailable here: vm.nr_hugepages is 0. "
    )
    assert "take 'cpu.hugetlb' out of LMCACHE_PLATFORM_BACKEND" in hint and report["ok"] is False


def test_the_text_report_sizes_its_columns_to_the_longest_name(lmcache_registry):
    lmcache_registry.install("cpu", backend(probe=Availability.no("/dev/shm is missing")), distribution="d")
    hook = lambda device_type: [DoctorFinding.info("keeps KV caches in huge pages")]  # noqa: E731
    lmcache_registry.install("cpu.hugetlb", backend(doctor_hook=hook), distribution="acme-hugetlb")
    lines = doctor.format_text(doctor.collect()).splitlines()
    width = len("cpu.hugetlb") + 1
    assert lines[0].startswith("python".ljust(width)) and lines[0][width] != " "
    assert "cpu.hugetlb".ljust(width) + "keeps KV caches in huge pages" in lines
    rows = [line[width:] for line in lines if line.startswith("backend ")]
    assert [row.split()[0] for row in rows] == ["cpu", "cpu.hugetlb"]
    assert len({row.index(row.split()[1]) for row in rows}) == 1  # the distributions line up
    assert len({row.index(row.split()[3]) for row in rows}) == 1  # and the statuses
