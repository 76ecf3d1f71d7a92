/**
 * A single-producer / single-consumer byte ring in shared memory, for same-host edges.
 *
 * Node has no shared-memory API, so the ring is a file under /dev/shm mapped with libc `mmap`
 * through koffi, viewed as an `ArrayBuffer` (`koffi.view`). Layout:
 *
 * | byte | field                                                                    |
 * |------|--------------------------------------------------------------------------|
 * |    0 | i32 head: write cursor, mod M (producer stores, consumer loads)           |
 * |   64 | i32 tail: read cursor, mod M (consumer stores, producer loads)            |
 * |  128 | i32 pending bit: 1 while a doorbell is outstanding or the consumer is awake |
 * |  192 | i32 credited: window bytes the consumer has freed, mod 2^32 (consumer adds)|
 * |  208 | i32 producer waiting: 1 while the producer waits for window                |
 * |  D   | data: `capacity` bytes, frames written back to back, wrapping             |
 *
 * Alignment: `capacity` is the window rounded up to the frame alignment A = max(8, alignment) and
 * the data starts at D = max(256, A), so every frame (a multiple of A long) starts A-aligned in the
 * mapping. Cursors run modulo M, the largest multiple of `capacity` below 2^31, so positions stay
 * exact however many bytes flow.
 *
 * Cursors and the pending bit are accessed with `Atomics` (sequentially consistent), so a head
 * published after the bytes it covers is never seen before them. The ring carries the same
 * encoded frames as the socket transports and is drained into the same stream decoder, so framing,
 * ordering, window and fault rules are identical; only the bytes skip the kernel. Wake-ups keep
 * PendingBit semantics: the producer rings the doorbell (a `DoorbellFrame` on the edge's Unix
 * socket) only when it flips the pending bit from 0 to 1; the consumer clears the bit before it
 * drains, so no wake-up is lost and a burst costs one doorbell.
 *
 * A consumer that busy-polls (`spinMicros`) keeps the pending bit set while it is awake, so the
 * producer skips the doorbell; it clears the bit and drains once more before it sleeps.
 *
 * Window credits also go through the ring (`credited`); the consumer sends a doorbell back on the
 * socket only when the producer has said it is waiting. The producer never has more than
 * `capacity` uncredited bytes (the edge's window), and the consumer drains bytes before it credits
 * them, so a write always fits.
 *
 * The producer creates the file (mode 0600) and unlinks it once the consumer has attached; the
 * mapping lives until both sides `close`. Linux only (x86-64 / arm64 libc).
 */
import { randomBytes } from "node:crypto"
import * as Fs from "node:fs"
import { createRequire } from "node:module"

type Koffi = typeof import("koffi")
let koffiModule: Koffi | undefined
/** koffi is loaded on first use, so importing the data plane costs nothing when shm is unused. */
const koffi = (): Koffi => (koffiModule ??= createRequire(import.meta.url)("koffi") as Koffi)

export const CONTROL_BYTES = 256
const HEAD = 0
const TAIL = 16
const PENDING = 32
const CREDITED = 48
const WAITING = 52
export const SHM_PREFIX = "/dev/shm/swactor-"

interface Libc {
  readonly open: (path: string, flags: number, mode: number) => number
  readonly ftruncate: (fd: number, length: number) => number
  readonly mmap: (addr: unknown, length: number, prot: number, flags: number, fd: number, offset: number) => unknown
  readonly munmap: (addr: unknown, length: number) => number
  readonly close: (fd: number) => number
}

let libc: Libc | undefined
const loadLibc = (): Libc => {
  if (libc !== undefined) return libc
  const lib = koffi().load("libc.so.6")
  libc = {
    open: lib.func("int open(const char *path, int flags, int mode)"),
    ftruncate: lib.func("int ftruncate(int fd, int64_t length)"),
    mmap: lib.func("void *mmap(void *addr, size_t length, int prot, int flags, int fd, int64_t offset)"),
    munmap: lib.func("int munmap(void *addr, size_t length)"),
    close: lib.func("int close(int fd)")
  }
  return libc
}

const O_RDWR = 2
const O_CREAT = 64
const O_EXCL = 128
const PROT_READ_WRITE = 3
const MAP_SHARED = 1
const MAP_PRIVATE = 2
const MAP_FIXED = 0x10
const MAP_ANONYMOUS = 0x20

/** Is shared memory usable here (Linux with /dev/shm and libc)? */
export const isSupported = (): boolean => {
  try {
    if (process.platform !== "linux" || !Fs.existsSync("/dev/shm")) return false
    loadLibc()
    return true
  } catch {
    return false
  }
}

/** A path the consumer accepts: under /dev/shm, named by us, no traversal. */
export const isRingPath = (path: string): boolean =>
  path.startsWith(SHM_PREFIX) && /^[A-Za-z0-9_.-]+$/.test(path.slice(SHM_PREFIX.length)) && !path.includes("..")

/**
 * Unmaps a ring whose bytes were lent out as views (`drainViews`) once no view of it is left: a view read after
 * `munmap` would crash the process. Until then the range holds fresh anonymous pages (see `close`).
 */
const unmapWhenUnreachable = new FinalizationRegistry<{ readonly pointer: unknown; readonly length: number }>(
  (mapping) => void loadLibc().munmap(mapping.pointer, mapping.length)
)

export class ShmRing {
  private readonly buffer: ArrayBuffer
  private readonly control: Int32Array
  private readonly data: Uint8Array
  private closed = false
  private lent = false

  /** Cursor modulus: a multiple of `capacity`, below 2^31. */
  private readonly modulus: number

  private constructor(
    readonly path: string,
    readonly capacity: number,
    dataOffset: number,
    private readonly pointer: unknown,
    private readonly length: number
  ) {
    const buffer = koffi().view(pointer, length)
    this.buffer = buffer
    this.control = new Int32Array(buffer, 0, CONTROL_BYTES / 4)
    this.data = new Uint8Array(buffer, dataOffset, capacity)
    this.modulus = Math.floor(0x7fff_ffff / capacity) * capacity
  }

  private static map(path: string, window: number, alignment: number, create: boolean): ShmRing {
    const c = loadLibc()
    const a = Math.max(8, alignment)
    const capacity = Math.ceil(window / a) * a
    const dataOffset = Math.max(CONTROL_BYTES, a)
    const length = dataOffset + capacity
    const fd = c.open(path, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0o600)
    if (fd < 0) throw new Error(`cannot open ${path}`)
    try {
      if (create) {
        if (c.ftruncate(fd, length) !== 0) throw new Error(`cannot size ${path}`)
      } else if (Fs.fstatSync(fd).size !== length) {
        throw new Error(`${path} is not a ring of ${capacity} bytes`)
      }
      const pointer = c.mmap(null, length, PROT_READ_WRITE, MAP_SHARED, fd, 0)
      if (pointer === null || koffi().address(pointer) === BigInt("0xffffffffffffffff"))
        throw new Error(`cannot map ${path}`)
      return new ShmRing(path, capacity, dataOffset, pointer, length)
    } finally {
      c.close(fd)
    }
  }

  /** Producer: create a fresh ring file for an edge's window. Throws when shared memory is unavailable. */
  static create(window: number, alignment: number): ShmRing {
    const path = `${SHM_PREFIX}${process.pid}-${randomBytes(8).toString("hex")}.ring`
    try {
      return ShmRing.map(path, window, alignment, true)
    } catch (e) {
      Fs.rmSync(path, { force: true })
      throw e
    }
  }

  /** Consumer: map the ring the producer named. Throws on a bad path or size. */
  static open(path: string, window: number, alignment: number): ShmRing {
    if (!isRingPath(path)) throw new Error(`refusing shared-memory path ${JSON.stringify(path)}`)
    return ShmRing.map(path, window, alignment, false)
  }

  private distance(from: number, to: number): number {
    return (to - from + this.modulus) % this.modulus
  }

  /** Remove the file name (the mapping stays valid). */
  unlink(): void {
    Fs.rmSync(this.path, { force: true })
  }

  /** Bytes written and not yet drained. */
  get used(): number {
    if (this.closed) return 0
    return this.distance(Atomics.load(this.control, TAIL), Atomics.load(this.control, HEAD))
  }

  /** Producer: append `bytes`; false (nothing written) when they do not fit. */
  write(bytes: Uint8Array): boolean {
    if (this.closed) return false
    const head = Atomics.load(this.control, HEAD)
    const tail = Atomics.load(this.control, TAIL)
    if (this.distance(tail, head) + bytes.length > this.capacity) return false
    const at = head % this.capacity
    const first = Math.min(bytes.length, this.capacity - at)
    this.data.set(bytes.subarray(0, first), at)
    if (first < bytes.length) this.data.set(bytes.subarray(first), 0)
    Atomics.store(this.control, HEAD, (head + bytes.length) % this.modulus)
    return true
  }

  /**
   * Producer: append `length` bytes that `fill` writes in place, so a frame is encoded straight into the ring
   * (one copy of its payload instead of two). When the free space wraps around the end of the ring, `fill` writes
   * a temporary buffer that is then copied in. False (nothing written, `fill` not called) when they do not fit.
   */
  writeWith(length: number, fill: (slot: Uint8Array) => void): boolean {
    if (this.closed) return false
    const head = Atomics.load(this.control, HEAD)
    const tail = Atomics.load(this.control, TAIL)
    if (this.distance(tail, head) + length > this.capacity) return false
    const at = head % this.capacity
    if (at + length <= this.capacity) {
      fill(this.data.subarray(at, at + length))
    } else {
      const slot = new Uint8Array(length)
      fill(slot)
      const first = this.capacity - at
      this.data.set(slot.subarray(0, first), at)
      this.data.set(slot.subarray(first), 0)
    }
    Atomics.store(this.control, HEAD, (head + length) % this.modulus)
    return true
  }

  /** Producer: set the pending bit; true when it was clear, i.e. the consumer must be woken. */
  raisePending(): boolean {
    return !this.closed && Atomics.exchange(this.control, PENDING, 1) === 0
  }

  /** Consumer: mark itself awake (the producer need not ring). */
  claimAwake(): void {
    if (!this.closed) Atomics.store(this.control, PENDING, 1)
  }

  /** Consumer: free `bytes` of window; true when the producer is waiting and must be woken. */
  addCredit(bytes: number): boolean {
    if (this.closed) return false
    Atomics.add(this.control, CREDITED, bytes | 0)
    return Atomics.exchange(this.control, WAITING, 0) === 1
  }

  /** Producer: total bytes credited so far, mod 2^32. */
  get credited(): number {
    return this.closed ? 0 : Atomics.load(this.control, CREDITED) >>> 0
  }

  /** Producer: announce that it waits for window (then re-check `credited`). */
  setProducerWaiting(): void {
    if (!this.closed) Atomics.store(this.control, WAITING, 1)
  }

  /**
   * Consumer: clear the pending bit (unless `stayAwake`), then take every byte written so far (a
   * copy); undefined when there is none, "corrupt" when the cursors are impossible.
   */
  drain(stayAwake = false): Uint8Array | undefined | "corrupt" {
    const range = this.take(stayAwake)
    if (range === undefined || range === "corrupt") return range
    const { at, first, head, n } = range
    const out = new Uint8Array(n)
    out.set(this.data.subarray(at, at + first), 0)
    if (first < n) out.set(this.data.subarray(0, n - first), first)
    Atomics.store(this.control, TAIL, head)
    return out
  }

  /**
   * Consumer: like `drain`, but the bytes are views of the ring itself (one, or two when they wrap around its end),
   * not a copy. They stay intact while the producer keeps to the window: it never has more than `capacity`
   * uncredited bytes, so bytes not credited back yet are never written again.
   */
  drainViews(stayAwake = false): ReadonlyArray<Uint8Array> | undefined | "corrupt" {
    const range = this.take(stayAwake)
    if (range === undefined || range === "corrupt") return range
    this.lent = true
    const { at, first, head, n } = range
    const views = [this.data.subarray(at, at + first)]
    if (first < n) views.push(this.data.subarray(0, n - first))
    Atomics.store(this.control, TAIL, head)
    return views
  }

  /**
   * Consumer: clear the pending bit (unless `stayAwake`) and find every byte written so far: `n` bytes from `at`,
   * `first` of them before the ring's end; the caller moves the tail to `head` once it has them. Undefined when there
   * is none, "corrupt" when the cursors are impossible.
   */
  private take(
    stayAwake: boolean
  ):
    { readonly at: number; readonly first: number; readonly head: number; readonly n: number } | undefined | "corrupt" {
    if (this.closed) return undefined
    if (!stayAwake) Atomics.store(this.control, PENDING, 0)
    const head = Atomics.load(this.control, HEAD)
    const tail = Atomics.load(this.control, TAIL)
    if (head < 0 || head >= this.modulus || tail < 0 || tail >= this.modulus) return "corrupt"
    const n = this.distance(tail, head)
    if (n === 0) return undefined
    if (n > this.capacity) return "corrupt"
    const at = tail % this.capacity
    return { at, first: Math.min(n, this.capacity - at), head, n }
  }

  /** Tests only: place both cursors at `position` (mod M), e.g. just before the modulus wraps. */
  unsafeSetCursors(position: number): void {
    const p = ((position % this.modulus) + this.modulus) % this.modulus
    Atomics.store(this.control, HEAD, p)
    Atomics.store(this.control, TAIL, p)
  }

  close(): void {
    if (this.closed) return
    this.closed = true
    if (this.lent) {
      // Views of it may still exist: give the shared pages back now by mapping fresh anonymous (zero, untouched)
      // pages over the range, and unmap the range once the last view is gone.
      const c = loadLibc()
      c.mmap(this.pointer, this.length, PROT_READ_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
      unmapWhenUnreachable.register(this.buffer, { pointer: this.pointer, length: this.length })
    } else loadLibc().munmap(this.pointer, this.length)
  }
}
