/**
 * Model facts: what planning needs to know about a GGUF model (layer count, hidden size, context length, EOS id),
 * read from its metadata only, never its tensor data. One service so the orchestrator, `swactor plan` and anything
 * else read the same facts the same way. The live layer reads the GGUF header (src/layers/gguf/ModelCatalogLive.ts); the
 * test layer answers from a table.
 */
import { Context, type Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../domain/gguf.js"
import type { ModelFacts, ModelLayout } from "../domain/plan.js"

export interface ModelCatalogService {
  /** The facts of the GGUF file at `path`; a file that is not a readable GGUF model is a `ModelLoadError`. */
  readonly facts: (path: string) => Effect.Effect<ModelFacts, ModelLoadError>
  /** Bytes per block, embeddings, output head and KV per token, from the file's tensor table (placement). */
  readonly layout: (path: string) => Effect.Effect<ModelLayout, ModelLoadError>
  /** The file's header, metadata and tensor table (no tensor data): what a stage loads is decided from it. */
  readonly header: (path: string) => Effect.Effect<GgufFile, ModelLoadError>
}

export class ModelCatalog extends Context.Tag("swactor/ModelCatalog")<ModelCatalog, ModelCatalogService>() {}
