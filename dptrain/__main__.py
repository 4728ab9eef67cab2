"""`python -m dptrain ...` (and `torchrun ... -m dptrain ...`): the `dptrain` command."""

if __name__ == "__main__":
    from dptrain.cli.main import main  # imported here: importing this module loads no Hydra

    main()
