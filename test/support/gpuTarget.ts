/**
 * Which GPU backend the test/gpu files run against (issue 42): SWACTOR_GPU_TEST_BACKEND=cuda runs them on the
 * machine's CUDA device (scripts/device-check.sh on a lent GPU machine); unset or `vulkan`, on Mesa's lavapipe as CI
 * does, forced in every process by VK_ICD_FILENAMES and GGML_VK_VISIBLE_DEVICES=0 so the machine does not choose the
 * device. test/support/vulkanReference.mjs reads the same variable for node-llama-cpp's build.
 */
import { existsSync } from "node:fs"

export type GpuTestBackend = "vulkan" | "cuda"

const chosen = process.env["SWACTOR_GPU_TEST_BACKEND"] ?? "vulkan"
if (chosen !== "vulkan" && chosen !== "cuda") {
  throw new Error(`SWACTOR_GPU_TEST_BACKEND=${chosen}: expected vulkan (the default, lavapipe) or cuda`)
}

/** The backend under test: `--backend` of every swactor process and node-llama-cpp's `gpu` in the reference. */
export const gpuBackend: GpuTestBackend = chosen

const LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"

/** Variables that pick the device in every process a test starts: lavapipe's device 0, or CUDA's own choice. */
export const gpuDeviceEnv: Readonly<Record<string, string>> =
  gpuBackend === "vulkan"
    ? { VK_ICD_FILENAMES: LAVAPIPE_ICD, GGML_VK_VISIBLE_DEVICES: "0", SWACTOR_GPU_TEST_BACKEND: "vulkan" }
    : { SWACTOR_GPU_TEST_BACKEND: "cuda" }

/** Variables under which the backend finds no device (a missing ICD; no visible CUDA device). */
export const noGpuDeviceEnv: Readonly<Record<string, string>> =
  gpuBackend === "vulkan" ? { VK_ICD_FILENAMES: "/nonexistent/icd.json" } : { CUDA_VISIBLE_DEVICES: "-1" }

/** ggml's name of the device a stage takes, and what its description looks like (lavapipe's is llvmpipe). */
export const gpuDeviceName = gpuBackend === "vulkan" ? "Vulkan0" : "CUDA0"
export const gpuDescriptionPattern = gpuBackend === "vulkan" ? "llvmpipe.*" : ".+"

/** Fails the file's setup in one line when the backend's device cannot be there (lavapipe not installed). */
export const requireGpuDevice = (): void => {
  if (gpuBackend === "vulkan" && !existsSync(LAVAPIPE_ICD)) {
    throw new Error(
      `Mesa's lavapipe is not installed (looked for ${LAVAPIPE_ICD}): apt-get install mesa-vulkan-drivers`
    )
  }
}
