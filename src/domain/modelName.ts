/**
 * What `--model` names (issue 38): a local path (a file, a split set's part, a folder), a Hugging Face model by name,
 * or a URL. The names follow node-llama-cpp's `resolveModelFile` and llama.cpp's `-hf`:
 * - `hf:user/repo` or `hf:user/repo:Q8_0`: the hub's manifest names the file for that quantization tag ("latest"
 *   when none), the first part when it is a split set;
 * - `hf:user/repo/path/to/file.gguf` (optionally `#revision`): that file of the repository;
 * - `https://host/…/file.gguf` (or `http://`, for a LAN mirror): that file.
 * Pure parsing: resolving a name against a hub is src/layers/gguf/HubClient.ts.
 */

export type ModelName =
  | { readonly _tag: "Local"; readonly path: string }
  | {
      readonly _tag: "Hub"
      readonly user: string
      readonly repo: string
      /** A quantization tag for the manifest (absent with `file`). */
      readonly tag?: string
      /** A file path inside the repository. */
      readonly file?: string
      readonly revision: string
    }
  | { readonly _tag: "Url"; readonly url: string }

const HUB_PREFIXES = ["hf://", "huggingface://", "hf:", "huggingface:"] as const

/** A repository owner or name as the hub allows them (letters, digits, `-`, `_`, `.`; not `.`/`..`). */
const NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$/

/** Whether `named` is a hub name or a URL rather than a local path. */
export const isRemoteModel = (named: string): boolean =>
  HUB_PREFIXES.some((p) => named.startsWith(p)) || /^https?:\/\//i.test(named)

/** The name `--model` gave, or why it is not one (one line). A name that is neither hub nor URL is a path. */
export const parseModelName = (named: string): ModelName | { readonly message: string } => {
  const prefix = HUB_PREFIXES.find((p) => named.startsWith(p))
  if (prefix !== undefined) return parseHub(named, named.slice(prefix.length))
  if (/^https?:\/\//i.test(named)) {
    let url: URL
    try {
      url = new URL(named)
    } catch {
      return { message: `--model ${named}: not a valid URL` }
    }
    if (url.username !== "" || url.password !== "") {
      return { message: `--model ${url.host}: put no credentials in the URL (HF_TOKEN is sent to the hub)` }
    }
    if (!/\.gguf$/i.test(url.pathname)) return { message: `--model ${named}: a URL must name a .gguf file` }
    return { _tag: "Url", url: url.href }
  }
  return { _tag: "Local", path: named }
}

const parseHub = (named: string, rest: string): ModelName | { readonly message: string } => {
  const hash = rest.indexOf("#")
  const revision = hash < 0 ? "main" : rest.slice(hash + 1)
  const body = hash < 0 ? rest : rest.slice(0, hash)
  const usage =
    `--model ${named}: a hub model is hf:user/repo, hf:user/repo:QUANT (e.g. hf:user/repo:Q8_0) ` +
    `or hf:user/repo/path/file.gguf`
  if (revision === "" || !/^[A-Za-z0-9._/-]+$/.test(revision) || revision.includes("..")) {
    return { message: `--model ${named}: the revision after "#" must be a branch, tag or commit` }
  }
  const [user, repoAndTag, ...path] = body.split("/")
  if (user === undefined || repoAndTag === undefined || user === "" || repoAndTag === "") return { message: usage }
  if (path.length === 0) {
    const colon = repoAndTag.indexOf(":")
    const repo = colon < 0 ? repoAndTag : repoAndTag.slice(0, colon)
    const tag = colon < 0 ? undefined : repoAndTag.slice(colon + 1).trim()
    if (!NAME.test(user) || !NAME.test(repo)) return { message: usage }
    if (tag !== undefined && !/^[A-Za-z0-9._-]{1,64}$/.test(tag)) {
      return { message: `--model ${named}: the tag after ":" must be a quantization such as Q4_K_M` }
    }
    return { _tag: "Hub", user, repo, revision, ...(tag === undefined || tag === "" ? {} : { tag }) }
  }
  if (!NAME.test(user) || !NAME.test(repoAndTag)) return { message: usage }
  const file = path.join("/")
  if (path.some((p) => p === "" || p === "." || p === "..") || !/\.gguf$/i.test(file)) {
    return { message: `--model ${named}: the file inside the repository must be a .gguf path` }
  }
  return { _tag: "Hub", user, repo: repoAndTag, file, revision }
}
