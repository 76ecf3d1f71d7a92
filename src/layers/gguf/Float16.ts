/** F32 → F16 / BF16 conversion with round-to-nearest-even (same results as ggml's CPU reference conversions). */

const f32 = new Float32Array(1)
const u32 = new Uint32Array(f32.buffer)

export const f32ToF16Bits = (value: number): number => {
  f32[0] = value
  const x = u32[0]!
  const sign = (x >>> 16) & 0x8000
  const exp = (x >>> 23) & 0xff
  let mant = x & 0x7fffff
  if (exp === 0xff) return sign | 0x7c00 | (mant !== 0 ? 0x200 : 0)
  const e = exp - 127 + 15
  if (e >= 31) return sign | 0x7c00
  if (e <= 0) {
    if (e < -10) return sign
    mant |= 0x800000
    const shift = 14 - e
    let half = mant >>> shift
    const rem = mant & ((1 << shift) - 1)
    const halfway = 1 << (shift - 1)
    if (rem > halfway || (rem === halfway && (half & 1) === 1)) half++
    return sign | half
  }
  let half = (e << 10) | (mant >>> 13)
  const rem = mant & 0x1fff
  if (rem > 0x1000 || (rem === 0x1000 && (half & 1) === 1)) half++ // a carry rounds up into the exponent, as it should
  return sign | half
}

export const f16BitsToF32 = (h: number): number => {
  const sign = h & 0x8000 ? -1 : 1
  const exp = (h >>> 10) & 0x1f
  const mant = h & 0x3ff
  if (exp === 0) return sign * mant * 2 ** -24
  if (exp === 31) return mant === 0 ? sign * Infinity : NaN
  return sign * (1 + mant / 1024) * 2 ** (exp - 15)
}

export const f32ToBf16Bits = (value: number): number => {
  f32[0] = value
  const x = u32[0]!
  if ((x & 0x7fffffff) > 0x7f800000) return ((x >>> 16) | 64) & 0xffff
  return ((x + 0x7fff + ((x >>> 16) & 1)) >>> 16) & 0xffff
}

export const bf16BitsToF32 = (h: number): number => {
  u32[0] = (h & 0xffff) << 16
  return f32[0]!
}

/** Little-endian F16 bytes of `src`. */
export const toF16Bytes = (src: Float32Array): Uint8Array => {
  const out = new Uint16Array(src.length)
  for (let i = 0; i < src.length; i++) out[i] = f32ToF16Bits(src[i]!)
  return new Uint8Array(out.buffer)
}

/** Little-endian BF16 bytes of `src`. */
export const toBf16Bytes = (src: Float32Array): Uint8Array => {
  const out = new Uint16Array(src.length)
  for (let i = 0; i < src.length; i++) out[i] = f32ToBf16Bits(src[i]!)
  return new Uint8Array(out.buffer)
}
