"""Subjects are built by functions and events are checked against the subject they arrived on."""

from __future__ import annotations

import pytest

from rove.control.catalogue import subjects
from rove.control.errors import ConfigError, InvalidEventError
from tests import factories


def test_each_event_has_one_subject_under_its_job() -> None:
    assert subjects.subject_for(factories.joined("n1")) == "rove.ev.j1.node.n1"
    assert subjects.subject_for(factories.heartbeat("n1")) == "rove.hb.j1.n1"
    assert subjects.subject_for(factories.elected("m", 3)) == "rove.ev.j1.master.elected"
    assert subjects.subject_for(factories.lost("n1", 3)) == "rove.ev.j1.master.node_lost"
    assert subjects.subject_for(factories.stop()) == "rove.ev.j1.cmd"
    assert subjects.job_events("j1") == "rove.ev.j1.>"
    assert subjects.data("j1", "imagenet") == "rove.ev.j1.data.imagenet"
    assert subjects.plan("j1") == "rove.ev.j1.plan"
    assert subjects.scaler("j1") == "rove.ev.j1.scaler"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a*", ">", "-lead", "x" * 65, "j/1"])
def test_names_that_would_break_subjects_are_refused_with_a_clear_message(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid job name"):
        subjects.job_events(bad)


def test_a_fact_on_another_nodes_subject_is_refused() -> None:
    with pytest.raises(InvalidEventError, match=r"belongs on rove\.ev\.j1\.node\.n1"):
        subjects.check_subject(factories.joined("n1"), "rove.ev.j1.node.n2")


def test_a_fact_dressed_up_as_a_master_decision_is_refused() -> None:
    with pytest.raises(InvalidEventError):
        subjects.check_subject(factories.joined("n1"), "rove.ev.j1.master.node_lost")


def test_an_event_of_another_job_is_refused() -> None:
    with pytest.raises(InvalidEventError):
        subjects.check_subject(factories.joined("n1", job="j2"), "rove.ev.j1.node.n1")


def test_an_event_with_an_invalid_name_inside_is_refused_not_crashing() -> None:
    with pytest.raises(InvalidEventError):
        subjects.check_subject(factories.joined("bad.node"), "rove.ev.j1.node.bad")


@pytest.mark.parametrize("text", ["exp.1", "user@host:run 7", "é", "_x", "x" * 80, "a.b"])
def test_an_id_another_tool_chose_becomes_a_valid_name_alike_every_time(text: str) -> None:
    name = subjects.name_from(text)
    assert subjects.check_name("job", name) == name
    assert subjects.name_from(text) == name, "every node of a job derives the same name"


def test_a_valid_id_is_its_own_name_and_two_ids_never_share_one() -> None:
    assert subjects.name_from("exp-1") == "exp-1"
    assert subjects.name_from("exp.1").startswith("exp-1-")
    assert len({subjects.name_from(t) for t in ["a.b", "a b", "a/b", "a-b", "a:b"]}) == 5
    long = subjects.name_from("x" * 80)
    assert len(long) == 64 and long != subjects.name_from("x" * 81)
