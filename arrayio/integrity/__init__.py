"""What keeps data whole: CRC-32C checksums on the host and on the GPU, and atomic file
replacement with the cleanup of what killed writers leave."""
