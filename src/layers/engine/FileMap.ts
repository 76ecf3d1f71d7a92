/**
 * Read-only file mappings for a stage's weights (libc mmap through koffi). The page cache behind a mapping is
 * shared by every process mapping the same file, so stages of one model on one machine hold its bytes once.
 * A mapped range is checked against the file's size right before mapping: touching a page past the end of a
 * file raises SIGBUS, which no JS code could catch.
 */
import koffi from "koffi"
import * as Fs from "node:fs"

export interface FileRegion {
  /** The mapped file (a split set's part maps apart from the others). */
  readonly path: string
  /** File offset of the first mapped byte (a multiple of MAP_GRANULE). */
  readonly fileStart: number
  readonly length: number
  /** The mapping's address (koffi pointer) and its numeric value. */
  readonly base: unknown
  readonly addr: bigint
}

interface Libc {
  readonly mmap: {
    async: (
      addr: null,
      length: number,
      prot: number,
      flags: number,
      fd: number,
      offset: number,
      cb: (err: unknown, res: unknown) => void
    ) => void
  }
  readonly munmap: (addr: unknown, length: number) => number
  readonly madvise: ((addr: bigint, length: number, advice: number) => number) & {
    async: (addr: bigint, length: number, advice: number, cb: (err: unknown, res: number) => void) => void
  }
}

let libc: Libc | null | undefined
const loadLibc = (): Libc | null => {
  if (libc !== undefined) return libc
  try {
    const lib = koffi.load("libc.so.6")
    libc = {
      mmap: lib.func("void *mmap(void *addr, size_t length, int prot, int flags, int fd, int64_t offset)") as never,
      munmap: lib.func("int munmap(void *addr, size_t length)") as never,
      madvise: lib.func("int madvise(uintptr_t addr, size_t length, int advice)") as never
    }
  } catch {
    libc = null
  }
  return libc
}

/** Mapping offsets are rounded down to 64 KiB: a multiple of every Linux page size (4, 16, 64 KiB). */
export const MAP_GRANULE = 64 * 1024
/** Tensors closer than this share one mapping. */
const MERGE_GAP = 1024 * 1024
const PROT_READ = 1
const MAP_SHARED = 1
const MAP_POPULATE = 0x8000
const MAP_FAILED = 0xffffffffffffffffn

/** Can this process map files (Linux, libc loadable)? */
export const canMap = (): boolean => process.platform === "linux" && loadLibc() !== null

/** Byte ranges [start, end) merged into runs (gaps below MERGE_GAP joined), starts rounded down to MAP_GRANULE. */
export const mappingRuns = (ranges: ReadonlyArray<{ readonly offset: number; readonly size: number }>) => {
  const sorted = [...ranges].filter((r) => r.size > 0).sort((a, b) => a.offset - b.offset)
  const runs: Array<{ start: number; end: number }> = []
  for (const r of sorted) {
    const last = runs[runs.length - 1]
    if (last !== undefined && r.offset <= last.end + MERGE_GAP) last.end = Math.max(last.end, r.offset + r.size)
    else runs.push({ start: r.offset, end: r.offset + r.size })
  }
  return runs.map((r) => ({ fileStart: Math.floor(r.start / MAP_GRANULE) * MAP_GRANULE, end: r.end }))
}

/** A libc function by its C signature, loaded once; null where libc cannot be loaded. */
const libcFunctions = new Map<string, unknown>()
export const libcFunction = <F>(signature: string): F | null => {
  if (!libcFunctions.has(signature)) {
    let fn: unknown = null
    try {
      fn = koffi.load("libc.so.6").func(signature)
    } catch {
      fn = null
    }
    libcFunctions.set(signature, fn)
  }
  return libcFunctions.get(signature) as F | null
}

const MADV_DONTNEED = 4
const MADV_POPULATE_READ = 22
const PAGE = 4096n

/**
 * Prefaults the mapped byte ranges (`[address, bytes]`, each inside one of `regions`) off the event loop, as
 * MAP_POPULATE would have for the whole mapping: the weights read in place are resident before the first compute,
 * and nothing else is. Best effort (MADV_POPULATE_READ needs Linux 5.14; without it pages fault in on first use).
 */
export const populateRanges = async (
  regions: ReadonlyArray<FileRegion>,
  ranges: ReadonlyArray<readonly [bigint, number]>
): Promise<void> => {
  const c = loadLibc()
  if (c === null) return
  for (const [at, bytes] of ranges) {
    const r = regions.find((x) => at >= x.addr && at < x.addr + BigInt(x.length))
    if (r === undefined || bytes <= 0) continue
    const start = (at / PAGE) * PAGE
    const limit = r.addr + BigInt(r.length)
    const wanted = at + BigInt(bytes)
    const end = wanted > limit ? limit : wanted
    await new Promise<void>((resolve) =>
      c.madvise.async(start, Number(end - start), MADV_POPULATE_READ, () => resolve())
    )
  }
}

/**
 * Drops this process's pages of the mapped bytes [from, to) (rounded inward to MAP_GRANULE): they leave its resident
 * set (the page cache keeps them for other readers), and a later read would fault them in again from the file. The
 * mapping stays, so nothing else can be placed at those addresses. Returns the bytes released.
 */
export const releasePages = (from: bigint, to: bigint): number => {
  const c = loadLibc()
  if (c === null) return 0
  const g = BigInt(MAP_GRANULE)
  const start = ((from + g - 1n) / g) * g
  const end = (to / g) * g
  if (end <= start) return 0
  return c.madvise(start, Number(end - start), MADV_DONTNEED) === 0 ? Number(end - start) : 0
}

/**
 * Releases every page of `regions` outside the byte ranges still read in place (`keep`: [address, bytes]), e.g.
 * after a load set its repacked and unaligned tensors from the mapping. Returns the bytes released.
 */
export const releaseAllBut = (
  regions: ReadonlyArray<FileRegion>,
  keep: ReadonlyArray<readonly [bigint, number]>
): number => {
  const sorted = [...keep].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
  let released = 0
  for (const r of regions) {
    const end = r.addr + BigInt(r.length)
    let cursor = r.addr
    for (const [at, bytes] of sorted) {
      if (at + BigInt(bytes) <= r.addr || at >= end) continue
      released += releasePages(cursor, at)
      const after = at + BigInt(bytes)
      if (after > cursor) cursor = after
    }
    // rounded down: never past the mapping (a neighbour's pages there are not ours to drop)
    released += releasePages(cursor, end)
  }
  return released
}

export const unmapAll = (regions: ReadonlyArray<FileRegion>) => {
  const c = loadLibc()
  if (c === null) return
  for (const r of regions) c.munmap(r.base, r.length)
}

/**
 * Maps the runs of `ranges` of the file read-only, off the event loop; prefaulted with MAP_POPULATE unless
 * `populate: false` (then `populateRanges` prefaults only the bytes that will be read in place).
 * Rejects, with nothing left mapped, when the file is now shorter than a range or a mapping fails.
 */
export const mapRanges = async (
  path: string,
  ranges: ReadonlyArray<{ readonly offset: number; readonly size: number }>,
  options: { readonly populate?: boolean } = {}
): Promise<ReadonlyArray<FileRegion>> => {
  const flags = MAP_SHARED | (options.populate === false ? 0 : MAP_POPULATE)
  const c = loadLibc()
  if (c === null || process.platform !== "linux") throw new Error("file mapping is not available here")
  const runs = mappingRuns(ranges)
  const fd = Fs.openSync(path, "r")
  const regions: Array<FileRegion> = []
  try {
    const size = Fs.fstatSync(fd).size
    for (const r of runs) {
      if (r.end > size) throw new Error(`the file is ${size} bytes now, the stage's tensors end at ${r.end}`)
    }
    for (const r of runs) {
      const length = r.end - r.fileStart
      const base = await new Promise<unknown>((resolve, reject) =>
        c.mmap.async(null, length, PROT_READ, flags, fd, r.fileStart, (err, res) => {
          if (err) reject(err instanceof Error ? err : new Error(String(err)))
          else resolve(res)
        })
      )
      const addr = base === null ? 0n : koffi.address(base)
      if (addr === 0n || addr === MAP_FAILED) {
        throw new Error(`mmap of ${length} bytes at offset ${r.fileStart} failed`)
      }
      regions.push({ path, fileStart: r.fileStart, length, base, addr })
    }
    return regions
  } catch (e) {
    unmapAll(regions)
    throw e
  } finally {
    Fs.closeSync(fd)
  }
}

/** The region of file `path` holding [offset, offset + size) and the address of `offset` in it. */
export const locate = (regions: ReadonlyArray<FileRegion>, path: string, offset: number, size: number) => {
  for (const r of regions) {
    if (r.path === path && offset >= r.fileStart && offset + size <= r.fileStart + r.length) {
      return { region: r, addr: r.addr + BigInt(offset - r.fileStart) }
    }
  }
  return undefined
}
