/**
 * The number formats a node puts on the wire, and the wire version, stated in every connection's handshake (Auth.ts:
 * data-plane edges, control RPC and slice streams alike), so a mixed pipeline (x64 + arm64 nodes, issue 42) cannot
 * silently misread another node's activations.
 *
 * What travels, and in which format:
 * - activations: f32 elements written in the host's byte order (`ActivationFrame.payload`, a Float32Array copied as
 *   it is), so `f32-le` on a little-endian host, `f32-be` on a big-endian one;
 * - token ids: u32, always written little-endian (`u32-le`); frame headers and lengths are little-endian too;
 * - logits never travel (the last stage samples); a sampled token's log-probs are f64 little-endian, fixed by the
 *   wire version;
 * - weight slices are GGUF files, little-endian by the GGUF spec (`gguf-le`, stated in a slice stream's request).
 *
 * A peer whose wire version or formats differ is refused in one line (`WireMismatch`), and a big-endian host refuses
 * to start a stage (`HostByteOrderUnsupported`): swactor runs on little-endian hosts only (x86-64, arm64).
 */
import { Schema } from "effect"

/**
 * The wire protocol's version: every data-plane frame header carries it and every handshake states it. 1: the first
 * wire; 2: handshakes state the wire version and the number formats.
 */
export const WIRE_VERSION = 2

/** A host's byte order, in `os.endianness()`'s words. */
export type Endianness = "LE" | "BE"

/** What one side of a connection speaks: the wire version and its number formats (`<element>-<byte order>`). */
export const WireFormats = Schema.Struct({
  wire: Schema.Number,
  /** Activation elements, e.g. `f32-le`. */
  activations: Schema.String,
  /** Token ids, e.g. `u32-le`. */
  tokenIds: Schema.String
})
export type WireFormats = typeof WireFormats.Type

/** The formats a node of this release speaks on a host of `endianness`. */
export const nodeWireFormats = (endianness: Endianness): WireFormats => ({
  wire: WIRE_VERSION,
  activations: endianness === "BE" ? "f32-be" : "f32-le",
  tokenIds: "u32-le"
})

export const sameWireFormats = (a: WireFormats, b: WireFormats): boolean =>
  a.wire === b.wire && a.activations === b.activations && a.tokenIds === b.tokenIds

/** `wire 2 with activations f32-le, token ids u32-le`. */
export const describeWireFormats = (f: WireFormats): string =>
  `wire ${f.wire} with activations ${f.activations}, token ids ${f.tokenIds}`

/**
 * A handshake's peer speaks another wire version or other number formats (`theirs` absent: it stated none, a node of
 * wire 1). Refused on both sides, after both proved the cluster token; `message` is the one line to report.
 */
export class WireMismatch extends Schema.TaggedError<WireMismatch>()("WireMismatch", {
  /** The peer's address (host:port, or a socket path). */
  peer: Schema.String,
  theirs: Schema.optional(WireFormats),
  ours: WireFormats
}) {
  override get message() {
    const said =
      this.theirs === undefined
        ? "states no wire version or formats (a swactor of wire 1)"
        : `speaks ${describeWireFormats(this.theirs)}`
    return (
      `peer ${this.peer} ${said}; this node speaks ${describeWireFormats(this.ours)}: refused ` +
      "(every node of a pipeline must speak the same wire version and formats)"
    )
  }
}

/** This host is big-endian: it does not start stages (activations would be misread by little-endian peers). */
export class HostByteOrderUnsupported extends Schema.TaggedError<HostByteOrderUnsupported>()(
  "HostByteOrderUnsupported",
  { endianness: Schema.Literal("LE", "BE") }
) {
  override get message() {
    return (
      `this host is big-endian (os.endianness() ${this.endianness}): swactor runs stages on little-endian hosts only ` +
      "(x86-64, arm64), so it does not start one here"
    )
  }
}

/** Why a host of `endianness` cannot run a stage, or undefined when it can. */
export const hostByteOrderProblem = (endianness: Endianness): HostByteOrderUnsupported | undefined =>
  endianness === "LE" ? undefined : new HostByteOrderUnsupported({ endianness })
