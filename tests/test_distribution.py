"""Another installed distribution that provides the import package
``mlx_dspark`` is named, in one line, with what to do."""

import pytest

from mlx_dspark import distribution


def install_fake(site, name, version="1.0"):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    (info / "METADATA").write_text(metadata)
    (info / "top_level.txt").write_text("mlx_dspark\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    distribution.warn_about_other_providers.cache_clear()
    yield tmp_path
    distribution.warn_about_other_providers.cache_clear()


def test_another_provider_of_mlx_dspark_is_named_with_the_fix(site, capsys):
    install_fake(site, "mlx-lm-dspark")  # this project, as a wheel installs it
    distribution.warn_about_other_providers()
    assert capsys.readouterr().err == ""

    distribution.warn_about_other_providers.cache_clear()
    install_fake(site, "mlx-dspark", "0.20.3")
    distribution.warn_about_other_providers()
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "also installed by mlx-dspark" in err
    assert "pip uninstall mlx-dspark mlx-lm-dspark" in err


def test_loading_a_drafter_checks_once(site, capsys, checkpoint):
    import mlx_dspark

    install_fake(site, "mlx-dspark", "0.20.3")
    mlx_dspark.load_drafter(checkpoint, lazy=True)
    mlx_dspark.load_drafter(checkpoint, lazy=True)
    assert capsys.readouterr().err.count("also installed by mlx-dspark") == 1
