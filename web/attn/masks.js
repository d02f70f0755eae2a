// The look-ahead mask (section 3.2.3): the JavaScript twin of attn/masks.py.
//
// A mask is a Uint8Array (Tq, Tk), 1 where a query may attend to a key. The page translates
// one sentence at a time, so there is no padding and no padding mask: the encoder and the
// cross-attention see every source position.

// Queries at positions offset .. offset+Tq-1, keys at 0 .. Tk-1: position i sees keys 0..i.
// Decoding one position at a time with cached keys passes Tq = 1 and offset = t.
export function causalMask(Tq, Tk, offset = 0) {
  const mask = new Uint8Array(Tq * Tk);
  for (let i = 0; i < Tq; i++)
    for (let j = 0; j < Tk; j++) mask[i * Tk + j] = j <= offset + i ? 1 : 0;
  return mask;
}
