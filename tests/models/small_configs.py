"""Small constructor arguments of every registered model, shared by the model tests."""

#: Small constructor arguments per model, so that every test runs in milliseconds.
SMALL = {
    "digits_mlp": {},
    "mnist_cnn": {},
    "cifar10_cnn": {},
    "imdb_embedding": {"vocab_size": 50},
    "imdb_lstm": {"vocab_size": 50, "embed_dim": 8, "hidden_size": 6},
    "resnet18": {"num_classes": 3},
    "transformer": {"vocab_size": 40, "seq_len": 8, "n_layer": 2, "n_embd": 16, "n_head": 2},
}

