"""DG_REQUIRE_EMULATED_HOSTS=1 (``make test`` as root): a suite that needs emulated hosts
fails instead of skipping (tests/conftest.py)."""
import pytest

from conftest import REPO

pytest_plugins = ["pytester"]
SUITE = """
    import pytest
    # needs tools/emulated_cluster.py
    def test_across_hosts():
        pytest.skip("no network namespaces")
"""
OTHER = """
    import pytest
    def test_on_horovod_only():
        pytest.skip("horovod only")
"""


@pytest.fixture
def suites(pytester):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_hosts=SUITE, test_other=OTHER)
    return pytester


def test_an_emulated_host_suite_that_skips_fails_where_hosts_are_required(suites,
                                                                           monkeypatch):
    monkeypatch.setenv("DG_REQUIRE_EMULATED_HOSTS", "1")
    result = suites.runpytest("-p", "no:xdist")
    result.assert_outcomes(failed=1, skipped=1)      # other skips stay skips
    result.stdout.fnmatch_lines(["*skipped*no network namespaces*DG_REQUIRE_EMULATED_HOSTS=1*"])


def test_without_the_requirement_it_skips(suites, monkeypatch):
    monkeypatch.setenv("DG_REQUIRE_EMULATED_HOSTS", "0")
    suites.runpytest("-p", "no:xdist").assert_outcomes(skipped=2)
