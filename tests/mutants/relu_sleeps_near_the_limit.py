"""Each call sleeps just under the per-call limit: the layer's wall-time budget ends it."""
import time


def relu_forward(x):
    time.sleep(0.8)
    return x * (x > 0), x > 0


def relu_backward(dout, cache):
    time.sleep(0.8)
    return dout * cache
