/**
 * The order of data frames on one inbound edge (InboundCore.ts): step numbers consecutive from the edge's first, chunks
 * of a message consecutive from 0 with one `chunkCount` and one kind, and chunks joined into one frame where the edge
 * reassembles. Framing.ts encodes and decodes single frames; this is the edge's state across them.
 */
import { ActivationFrame, type DataFrame, Malformed, OutOfOrder, TokenFrame } from "../../domain/frames.js"

/** Result of feeding one data frame to a `Sequencer`. */
export type SequencerStep =
  | { readonly _tag: "Complete"; readonly frame: DataFrame }
  | { readonly _tag: "Partial" }
  | { readonly _tag: "Fault"; readonly fault: OutOfOrder | Malformed }

/**
 * Enforces the order of data frames on one edge — step numbers consecutive from
 * `initialStep`, chunks of a message consecutive from 0 with one `chunkCount` and one kind —
 * and (when `reassemble`) joins chunks into one frame.
 */
export class Sequencer {
  private nextStep: number
  private parts: Array<DataFrame> = []

  constructor(
    initialStep = 0,
    private readonly reassemble = true
  ) {
    this.nextStep = initialStep
  }

  get expected(): { readonly step: number; readonly chunkIndex: number } {
    return { step: this.nextStep, chunkIndex: this.parts.length }
  }

  accept(frame: DataFrame): SequencerStep {
    const expectedChunk = this.parts.length
    if (frame.step !== this.nextStep || frame.chunkIndex !== expectedChunk) {
      return {
        _tag: "Fault",
        fault: new OutOfOrder({
          expectedStep: this.nextStep,
          expectedChunk,
          step: frame.step,
          chunkIndex: frame.chunkIndex
        })
      }
    }
    const first = this.parts[0]
    if (first !== undefined) {
      const consistent =
        first._tag === frame._tag &&
        first.chunkCount === frame.chunkCount &&
        (frame._tag !== "ActivationFrame" ||
          (first._tag === "ActivationFrame" &&
            first.hiddenDim === frame.hiddenDim &&
            frame.startPos === first.startPos + this.parts.reduce((n, f) => n + (f as ActivationFrame).nTokens, 0)))
      if (!consistent) return { _tag: "Fault", fault: new Malformed({ detail: "chunk inconsistent with its message" }) }
    }
    if (frame.chunkCount === 1) {
      this.nextStep = (this.nextStep + 1) >>> 0
      return { _tag: "Complete", frame }
    }
    if (!this.reassemble) {
      if (frame.chunkIndex + 1 === frame.chunkCount) {
        this.parts = []
        this.nextStep = (this.nextStep + 1) >>> 0
      } else {
        this.parts.push(frame)
      }
      return { _tag: "Complete", frame }
    }
    this.parts.push(frame)
    if (this.parts.length < frame.chunkCount) return { _tag: "Partial" }
    const parts = this.parts
    this.parts = []
    this.nextStep = (this.nextStep + 1) >>> 0
    return { _tag: "Complete", frame: join(parts) }
  }
}

const join = (parts: ReadonlyArray<DataFrame>): DataFrame => {
  const first = parts[0]!
  if (first._tag === "ActivationFrame") {
    const acts = parts as ReadonlyArray<ActivationFrame>
    const nTokens = acts.reduce((n, f) => n + f.nTokens, 0)
    const payload = new Float32Array(nTokens * first.hiddenDim)
    let at = 0
    for (const f of acts) {
      payload.set(f.payload, at)
      at += f.payload.length
    }
    return ActivationFrame({
      runId: first.runId,
      edgeId: first.edgeId,
      step: first.step,
      chunkIndex: 0,
      chunkCount: 1,
      startPos: first.startPos,
      nTokens,
      hiddenDim: first.hiddenDim,
      dtype: first.dtype,
      payload,
      ...(first.drafts === undefined ? {} : { drafts: first.drafts })
    })
  }
  const tokens: Array<number> = []
  for (const f of parts as ReadonlyArray<TokenFrame>) {
    if (f.payload._tag === "Prompt") for (const t of f.payload.tokens) tokens.push(t)
  }
  return TokenFrame({
    runId: first.runId,
    edgeId: first.edgeId,
    step: first.step,
    chunkIndex: 0,
    chunkCount: 1,
    payload: { _tag: "Prompt", tokens }
  })
}
