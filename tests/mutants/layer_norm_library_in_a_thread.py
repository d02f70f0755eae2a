"""The library's own layer norm, run in threads the learner's functions start (the
call tracing follows threads started during a call)."""
import threading, queue
from attn import layers as L

def layer_norm_forward(x, gamma, beta, eps=1e-5):
    q = queue.Queue()
    t = threading.Thread(target=lambda: q.put(L.layer_norm_forward(x, gamma, beta, eps)))
    t.start(); t.join()
    return q.get()

def layer_norm_backward(dout, cache):
    q = queue.Queue()
    t = threading.Thread(target=lambda: q.put(L.layer_norm_backward(dout, cache)))
    t.start(); t.join()
    return q.get()
