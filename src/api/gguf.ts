/**
 * GGUF files, the library's `Gguf` namespace: the file's values and tensors (domain/gguf.ts), ggml's type table
 * (domain/ggmlTypes.ts), the validating reader, the writer and the half-precision conversions they use.
 */
export * from "../domain/gguf.js"
export * from "../domain/ggmlTypes.js"
export * from "../layers/gguf/GgufReader.js"
export * from "../layers/gguf/GgufWriter.js"
export * from "../layers/gguf/Float16.js"
