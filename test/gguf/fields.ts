/**
 * Test helper: the byte layout of a VALID GGUF file, field by field, so corpus and fuzz tests can corrupt one named
 * field (a tensor's offset, a key's length) and know which error to expect. Independent of the reader under test.
 */

export type FieldKind =
  | "magic"
  | "version"
  | "tensorCount"
  | "kvCount"
  | "keyLength"
  | "keyBytes"
  | "valueType"
  | "itemType"
  | "arrayLength"
  | "stringLength"
  | "stringBytes"
  | "scalar"
  | "nameLength"
  | "nameBytes"
  | "nDims"
  | "dim"
  | "ggmlType"
  | "tensorOffset"

export interface Field {
  readonly kind: FieldKind
  readonly at: number
  readonly size: number
  /** Metadata key or tensor name the field belongs to. */
  readonly owner?: string
  /** Dimension index for "dim". */
  readonly index?: number
}

export interface Layout {
  readonly fields: ReadonlyArray<Field>
  readonly tableStart: number
  readonly tableEnd: number
  readonly tensorNames: ReadonlyArray<string>
}

const scalarBytes: Record<number, number> = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 }

export const fieldLayout = (bytes: Uint8Array): Layout => {
  const v = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  const fields: Array<Field> = []
  let p = 0
  const take = (kind: FieldKind, size: number, owner?: string, index?: number): number => {
    const at = p
    fields.push({
      kind,
      at,
      size,
      ...(owner !== undefined ? { owner } : {}),
      ...(index !== undefined ? { index } : {})
    })
    p += size
    return at
  }
  const u32 = (at: number) => v.getUint32(at, true)
  const u64 = (at: number) => Number(v.getBigUint64(at, true))
  const str = (lenKind: FieldKind, bytesKind: FieldKind, owner?: string): string => {
    const n = u64(take(lenKind, 8, owner))
    const at = take(bytesKind, n, owner)
    return new TextDecoder().decode(bytes.subarray(at, at + n))
  }
  take("magic", 4)
  take("version", 4)
  const nTensors = u64(take("tensorCount", 8))
  const nKv = u64(take("kvCount", 8))
  for (let i = 0; i < nKv; i++) {
    const key = str("keyLength", "keyBytes")
    const type = u32(take("valueType", 4, key))
    if (type === 9) {
      const item = u32(take("itemType", 4, key))
      const n = u64(take("arrayLength", 8, key))
      for (let j = 0; j < n; j++) {
        if (item === 8) str("stringLength", "stringBytes", key)
        else take("scalar", scalarBytes[item]!, key)
      }
    } else if (type === 8) {
      str("stringLength", "stringBytes", key)
    } else {
      take("scalar", scalarBytes[type]!, key)
    }
  }
  const tableStart = p
  const tensorNames: Array<string> = []
  for (let i = 0; i < nTensors; i++) {
    const name = str("nameLength", "nameBytes")
    tensorNames.push(name)
    for (const k of [fields.length - 2, fields.length - 1]) fields[k] = { ...fields[k]!, owner: name }
    const nDims = u32(take("nDims", 4, name))
    for (let d = 0; d < nDims; d++) take("dim", 8, name, d)
    take("ggmlType", 4, name)
    take("tensorOffset", 8, name)
  }
  return { fields, tableStart, tableEnd: p, tensorNames }
}

export const findField = (layout: Layout, kind: FieldKind, owner?: string, index?: number): Field => {
  const f = layout.fields.find(
    (x) => x.kind === kind && (owner === undefined || x.owner === owner) && (index === undefined || x.index === index)
  )
  if (f === undefined) throw new Error(`no ${kind} field for ${owner ?? "-"} ${index ?? ""}`)
  return f
}

/** A copy of `bytes` with a little-endian integer written over `field`. */
export const withInt = (bytes: Uint8Array, field: Field, value: bigint | number): Uint8Array => {
  const out = bytes.slice()
  const v = new DataView(out.buffer)
  if (field.size === 8) v.setBigUint64(field.at, BigInt.asUintN(64, BigInt(value)), true)
  else if (field.size === 4) v.setUint32(field.at, Number(BigInt.asUintN(32, BigInt(value))), true)
  else if (field.size === 2) v.setUint16(field.at, Number(value) & 0xffff, true)
  else if (field.size === 1) v.setUint8(field.at, Number(value) & 0xff)
  else throw new Error(`cannot write an integer over a ${field.size}-byte field`)
  return out
}

export const readInt = (bytes: Uint8Array, field: Field): bigint => {
  const v = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (field.size === 8) return v.getBigInt64(field.at, true)
  if (field.size === 4) return BigInt(v.getUint32(field.at, true))
  if (field.size === 2) return BigInt(v.getUint16(field.at, true))
  return BigInt(v.getUint8(field.at))
}
