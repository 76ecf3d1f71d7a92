/** What the planner needs to know about a GGUF file, read from its metadata (see the `ModelCatalog` service). */
export { readModelFacts } from "../layers/gguf/ModelCatalogLive.js"
