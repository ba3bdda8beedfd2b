"""The OpenMP waiting default (sloserve/openmp.py): a bounded spin unless the user chose."""

from sloserve.openmp import SPIN_COUNT, default_waiting


def test_an_unset_environment_gets_the_bounded_spin():
    env: dict[str, str] = {}
    default_waiting(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_an_explicit_wait_policy_is_left_alone():
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    default_waiting(env)
    assert env == {
        "OMP_WAIT_POLICY": "PASSIVE"
    }  # no spin count that would override passive waiting


def test_an_explicit_spin_count_is_left_alone():
    env = {"GOMP_SPINCOUNT": "0"}
    default_waiting(env)
    assert env == {"GOMP_SPINCOUNT": "0"}
