/**
 * The one metadata error of the hyperparameter readers (HParams.ts, Moe.ts, archs/*): a ModelLoadError
 * (InvalidMetadata) naming the key, its message `metadata "<key>" <what is wrong>` (`is missing`, `= 0 must be > 0`,
 * ...), and the check that a key holds one number.
 */
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../domain/gguf.js"
import { getOptional } from "../gguf/GgufReader.js"

/** InvalidMetadata naming `key`: `metadata "<key>" <message>`. */
export const invalidMetadata = (file: GgufFile, key: string, message: string): ModelLoadError =>
  new ModelLoadError({ path: file.path, reason: "InvalidMetadata", message: `metadata "${key}" ${message}` })

/** A key that must be a single number when present (a per-layer array is refused by name). */
export const scalarKey = <A>(
  file: GgufFile,
  key: string,
  read: (file: GgufFile, key: string) => Effect.Effect<A, ModelLoadError>
): Effect.Effect<A | undefined, ModelLoadError> =>
  Array.isArray(file.metadata.get(key))
    ? Effect.fail(invalidMetadata(file, key, "is an array; swactor reads it as one number"))
    : getOptional(file, key, read)
