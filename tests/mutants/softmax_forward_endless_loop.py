"""A softmax whose forward never returns."""


def softmax_forward(x, mask=None):
    while True:
        pass


def softmax_backward(dy, cache):
    y = cache
    return y * (dy - (dy * y).sum(axis=-1, keepdims=True))
