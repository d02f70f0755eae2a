"""Writes a 50 MB file in its working folder: the file size limit stops it."""


def relu_forward(x):
    with open("big.bin", "wb") as f:
        for _ in range(50):
            f.write(b"\0" * 2**20)
    return x * (x > 0), x > 0


def relu_backward(dout, cache):
    return dout * cache
