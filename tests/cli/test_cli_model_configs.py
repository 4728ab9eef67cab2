"""The model configs build the paper's models with their published parameter counts."""

import pytest
from hydra import compose, initialize_config_module
from hydra.utils import instantiate


@pytest.mark.parametrize(
    "model, params",
    [
        ("mnist_cnn", 26_010),
        ("cifar10_cnn", 605_226),
        ("imdb_embedding", 160_098),
        ("imdb_lstm", 1_081_402),
    ],
)
def test_paper_model_configs_have_the_published_parameter_counts(model, params):
    dataset = "imdb" if model.startswith("imdb") else model.split("_")[0]
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"dataset={dataset}"])
    built = instantiate(cfg.model)
    assert sum(p.numel() for p in built.parameters()) == params


@pytest.mark.parametrize(
    "recipe, model",
    [
        ("mnist_cnn", "mnist_cnn"),
        ("cifar10_cnn", "cifar10_cnn"),
        ("imdb_embedding", "imdb_embedding"),
        ("imdb_lstm", "imdb_lstm"),
        ("digits_quick", "digits_mlp"),
    ],
)
def test_each_recipe_selects_its_model_and_matching_dataset(recipe, model):
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"+recipe={recipe}"])
    assert cfg.model.name == model
    assert cfg.dataset.name == {
        "mnist_cnn": "mnist",
        "cifar10_cnn": "cifar10",
        "digits_mlp": "digits",
    }.get(model, "imdb")


@pytest.mark.parametrize(
    "model, dataset",
    [
        ("digits_mlp", "digits"),
        ("mnist_cnn", "mnist"),
        ("cifar10_cnn", "cifar10"),
        ("resnet18", "cifar10"),
        ("imdb_embedding", "imdb"),
        ("imdb_lstm", "imdb"),
        ("transformer", "imdb"),
    ],
)
def test_every_model_config_accepts_its_datasets_inputs_and_classes(model, dataset, tmp_path):
    from dptrain.cli.build import build_dataset, build_model, check_model_fits_data

    with initialize_config_module("dptrain.conf", version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"model={model}",
                f"dataset={dataset}",
                "dataset.synthetic=true",
                "dataset.max_samples=4",
            ],
        )
    splits = build_dataset(dict(cfg.dataset), seed=0)
    check_model_fits_data(build_model(cfg.model), splits, model)
