"""``[controller] state_password_file``: the PostgreSQL password copied for libpq, re-read.

Without a server: the private pgpass copy (its line, escaping and mode), what a bad edit
does, the DSN libpq is given, and the settings that refuse it. The rotation against a
real PostgreSQL while an agent keeps sending is ``tests/integration/test_rotation.py``.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from core.errors import ConfigError
from gpuhealth.config import fleet_problems, load_settings
from storage.sql import PasswordFile, server_of


def test_the_copy_is_a_private_pgpass_line_rewritten_on_change(tmp_path: Path) -> None:
    path = tmp_path / "password"
    path.write_text("s3cr:et\\x\n")  # echo's newline is not part of it
    pf = PasswordFile(path)
    try:
        assert pf.passfile.read_text() == "*:*:*:*:s3cr\\:et\\\\x\n"
        assert stat.S_IMODE(pf.passfile.stat().st_mode) == 0o600
        assert stat.S_IMODE(pf.passfile.parent.stat().st_mode) == 0o700
        assert pf.refresh() is False  # unchanged
        path.write_text("new-one")
        assert pf.refresh() is True
        assert pf.passfile.read_text() == "*:*:*:*:new-one\n"
        for bad, why in (("", "empty"), ("two\nlines\n", "more than one line")):
            path.write_text(bad)
            with pytest.raises(ConfigError, match=f"state_password_file {path}: {why}"):
                pf.refresh()
            assert pf.passfile.read_text() == "*:*:*:*:new-one\n"  # the one read before
            assert why in pf.problem
        path.unlink()
        with pytest.raises(ConfigError, match="No such file"):
            pf.refresh()
        path.write_text("third\r\n")
        assert pf.refresh() is True
        assert pf.passfile.read_text() == "*:*:*:*:third\n"
        assert pf.problem == ""
    finally:
        pf.close()
    assert not pf.passfile.parent.exists()


def test_libpq_reads_the_passfile_named_in_either_dsn_form(tmp_path: Path) -> None:
    conninfo = pytest.importorskip("psycopg.conninfo")
    path = tmp_path / "password"
    path.write_text("pw\n")
    pf = PasswordFile(path)
    try:
        for dsn in ("host=db port=5433 dbname=fleet user=gh",
                    "postgresql://gh@db:5433/fleet", "postgresql://gh@db:5433/fleet?sslmode=disable"):
            with_file = pf.dsn(dsn)
            parsed = conninfo.conninfo_to_dict(with_file)
            assert parsed["passfile"] == str(pf.passfile)
            assert parsed["host"] == "db"
            assert str(pf.passfile) not in server_of(with_file)
            assert server_of(with_file) == "db:5433/fleet"
    finally:
        pf.close()


def test_a_password_file_needs_a_postgres_state_without_a_password(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("pw\n")
    (tmp_path / "tokens").write_text("gpu-01 tok-one-0123456789abcdef\n")
    base = f"""
[node]
data_dir = "{tmp_path}"
[controller]
agent_tokens_file = "{tmp_path / 'tokens'}"
state_password_file = "{password}"
"""
    for state, why in (("", "state is not one"),
                       ('state = "/var/lib/gpuhealth/fleet.sqlite"\n', "state is not one"),
                       ('state = "host=db dbname=f password=x"\n', "state holds a password")):
        config = tmp_path / "bad.toml"
        config.write_text(base + state)
        with pytest.raises(ConfigError, match=why):
            load_settings(config, env={})
    config = tmp_path / "good.toml"
    config.write_text(base + 'state = "host=db dbname=f user=gh"\n')
    settings = load_settings(config, env={})
    assert settings.controller.state_password_file == password
    with pytest.raises(ConfigError, match="PGPASSWORD is set, and libpq would log in with it"):
        load_settings(config, env={"PGPASSWORD": "x"})
    password.unlink()
    assert any("state_password_file: no such file" in p for p in fleet_problems(settings, {}))


def test_the_controller_refuses_a_password_file_that_pgpassword_would_override(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuhealth.controller import Controller

    (tmp_path / "tokens").write_text("gpu-01 tok-one-0123456789abcdef\n")
    password = tmp_path / "password"
    password.write_text("pw\n")
    config = tmp_path / "ctl.toml"
    config.write_text(f"""
[node]
data_dir = "{tmp_path}"
[controller]
agent_tokens_file = "{tmp_path / 'tokens'}"
state = "host=127.0.0.1 port=1 dbname=f user=gh"
state_password_file = "{password}"
""")
    settings = load_settings(config, env={})
    monkeypatch.setenv("PGPASSWORD", "from-the-environment")
    with pytest.raises(ConfigError, match="PGPASSWORD is set"):
        Controller(settings)
    monkeypatch.delenv("PGPASSWORD")
    password.write_text("")
    with pytest.raises(ConfigError, match=f"state_password_file {password}: empty"):
        Controller(settings)
