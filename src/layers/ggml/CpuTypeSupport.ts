/**
 * Which ggml types a weight matrix may have on the CPU backend, asked of ggml itself rather than kept by hand.
 *
 * The CPU device's `supports_op` agrees to every MUL_MAT with an F32 input (ggml-cpu.cpp): it does not look at the
 * weight's type, and a product over a type without a dot product (Q8_K, Q8_1, I32, ...) would call a null function
 * pointer at compute time. So the answer comes from the type traits of the CPU backend that is loaded
 * (`ggml_get_type_traits_cpu`, exported by the libggml-cpu variant `ggml_backend_load_all_from_path` picked) and of
 * ggml-base (`ggml_get_type_traits`):
 * - MUL_MAT: the type has a `vec_dot`, and its `vec_dot_type` (the type the F32 input is converted to) a `from_float`;
 * - GET_ROWS (token_embd): quantized types need `to_float` (ggml-cpu's get_rows_q dequantizes through it);
 * - and the CPU device's `supports_op` agrees to a probe MUL_MAT and GET_ROWS node of the type (no compute).
 *
 * Ids that are not types of the pinned ggml (4, 5, 31-33, 36-38, or outside 0..GGML_TYPE_COUNT-1) are answered
 * false in TypeScript before any native call. Answers are cached per process.
 */
import koffi from "koffi"
import { readdirSync } from "node:fs"
import { join } from "node:path"
import { GGML_TYPE_COUNT, ggmlTypeInfo } from "../../domain/ggmlTypes.js"
import { type Ggml, GgmlBindingError, GgmlType, type Ptr } from "./Bindings.js"

interface TraitReaders {
  /** ggml_get_type_traits_cpu(type): from_float, vec_dot, vec_dot_type. */
  readonly cpu: (type: number) => { readonly fromFloat: boolean; readonly vecDot: boolean; readonly vecDotType: number }
  /** ggml_get_type_traits(type)->to_float !== NULL. */
  readonly toFloat: (type: number) => boolean
}

/** Offsets in `struct ggml_type_traits_cpu` (from_float, vec_dot, vec_dot_type) and `struct ggml_type_traits`. */
const CPU_TRAITS = { fromFloat: 0, vecDot: 8, vecDotType: 16 } as const
/** type_name (8), blck_size (8), blck_size_interleave (8), type_size (8), is_quantized (1 + 7 padding), to_float. */
const BASE_TRAITS_TO_FLOAT = 40

let dlInfo: ReturnType<typeof koffi.struct> | undefined

/** The file of the loaded library that holds `address` (dladdr), or undefined where that cannot be asked. */
const libraryOf = (address: Ptr): string | undefined => {
  const libc =
    process.platform === "linux"
      ? "libc.so.6"
      : process.platform === "darwin"
        ? "/usr/lib/libSystem.B.dylib"
        : undefined
  if (libc === undefined) return undefined
  try {
    const lib = koffi.load(libc)
    dlInfo ??= koffi.struct("swactor_dl_info", {
      dli_fname: "const char *",
      dli_fbase: "void *",
      dli_sname: "const char *",
      dli_saddr: "void *"
    })
    const dladdr = lib.func("dladdr", "int", ["void *", koffi.out(koffi.pointer(dlInfo))]) as (
      a: Ptr,
      out: { dli_fname?: string }
    ) => number
    const out: { dli_fname?: string } = {}
    return dladdr(address, out) !== 0 && typeof out.dli_fname === "string" ? out.dli_fname : undefined
  } catch {
    return undefined
  }
}

/** The CPU backend library ggml loaded: found by dladdr on one of its functions, else the only ggml-cpu file. */
const cpuLibraryPath = (g: Ggml): string => {
  g.cpuDevice() // loads the backends
  const reg = g.raw.ggml_backend_reg_by_name("CPU")
  const fn = reg === null ? null : g.raw.ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
  const found = fn === null ? undefined : libraryOf(fn)
  if (found !== undefined) return found
  const prefix = process.platform === "win32" ? "ggml-cpu" : "libggml-cpu"
  const files = readdirSync(g.library.dir).filter((f) => f.startsWith(prefix))
  if (files.length === 1) return join(g.library.dir, files[0]!)
  throw new GgmlBindingError(
    `cannot tell which of ${files.length} CPU backend libraries in ${g.library.dir} ggml loaded (no dladdr here)`
  )
}

const readersOf = new WeakMap<object, TraitReaders>()

const readers = (g: Ggml): TraitReaders => {
  const known = readersOf.get(g)
  if (known !== undefined) return known
  // dlopen of a library already loaded returns the same handle: nothing is initialised twice
  const cpuLib = koffi.load(cpuLibraryPath(g))
  const baseLib = koffi.load(join(g.library.dir, g.library.baseLib))
  const cpuTraits = cpuLib.func("void * ggml_get_type_traits_cpu(int type)") as (type: number) => Ptr
  const baseTraits = baseLib.func("void * ggml_get_type_traits(int type)") as (type: number) => Ptr
  const made: TraitReaders = {
    cpu: (type) => {
      const p = cpuTraits(type)
      return {
        fromFloat: koffi.decode(p, CPU_TRAITS.fromFloat, "void *") !== null,
        vecDot: koffi.decode(p, CPU_TRAITS.vecDot, "void *") !== null,
        vecDotType: koffi.decode(p, CPU_TRAITS.vecDotType, "int32_t") as number
      }
    },
    toFloat: (type) => koffi.decode(baseTraits(type), BASE_TRAITS_TO_FLOAT, "void *") !== null
  }
  readersOf.set(g, made)
  return made
}

/** The CPU device's supports_op on a probe MUL_MAT (F32 input) and GET_ROWS (I32 ids) of a `type` weight. */
const probeSupports = (g: Ggml, type: number, blockSize: number): boolean => {
  const raw = g.raw
  const ctx = raw.ggml_init({ mem_size: raw.ggml_tensor_overhead() * 8, mem_buffer: null, no_alloc: true })
  if (ctx === null) return false
  try {
    const dev = g.cpuDevice()
    const w = raw.ggml_new_tensor_2d(ctx, type, blockSize, 2)
    const x = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, blockSize, 3)
    const ids = raw.ggml_new_tensor_1d(ctx, GgmlType.I32, 3)
    return (
      raw.ggml_backend_dev_supports_op(dev, raw.ggml_mul_mat(ctx, w, x)) &&
      raw.ggml_backend_dev_supports_op(dev, raw.ggml_get_rows(ctx, w, ids))
    )
  } finally {
    raw.ggml_free(ctx)
  }
}

const answers = new Map<number, boolean>()

/**
 * Does the loaded CPU backend multiply (MUL_MAT with an F32 input) and gather (GET_ROWS) a weight of ggml type
 * `type`? False for ids that are no type of the pinned ggml, without a native call. Cached per process. Throws
 * GgmlBindingError when the libraries cannot be loaded.
 */
export const cpuComputesWeightType = (g: Ggml, type: number): boolean => {
  const known = answers.get(type)
  if (known !== undefined) return known
  const info = ggmlTypeInfo(type)
  let ok = false
  if (info !== undefined && type < GGML_TYPE_COUNT) {
    const r = readers(g)
    const t = r.cpu(type)
    const dotType = t.vecDotType
    ok =
      t.vecDot &&
      ggmlTypeInfo(dotType) !== undefined &&
      r.cpu(dotType).fromFloat &&
      (!info.quantized || r.toFloat(type)) &&
      probeSupports(g, type, info.blockSize)
  }
  answers.set(type, ok)
  return ok
}
