# A TrainMover host image, baked from each cloud's GPU base image (NVIDIA driver, CUDA, NCCL, EFA on AWS,
# InfiniBand on Azure) by bake.sh: the service user, and a Python 3.11+ with the pinned torch and TrainMover's own
# dependencies (docs/cloud-bootstrap.md, "Baking a host image"). TrainMover itself is not baked in: each job installs
# its own wheel at boot, checked against its digest.
#
#   packer init deploy/packer && packer build -only='amazon-ebs.gpu' -var aws_region=us-east-1 deploy/packer
#   packer build -only='azure-arm.gpu' -var azure_subscription_id=... -var azure_resource_group=rg deploy/packer
#
# bake.sh is `python -m cloud.image bake-script` for the defaults; for another torch, regenerate it:
#   python -m cloud.image bake-script --torch 2.13.0 --torch-index https://download.pytorch.org/whl/cu128 \
#     > deploy/packer/bake.sh
# Then give the job the image's versions as its contract (`python -m cloud.bootstrap check-image` runs at each boot).

packer {
  required_plugins {
    amazon = {
      source  = "github.com/hashicorp/amazon"
      version = ">= 1.3.0"
    }
    azure = {
      source  = "github.com/hashicorp/azure"
      version = ">= 2.1.0"
    }
  }
}

variable "aws_region" {
  type    = string
  default = "us-east-1"
}

variable "aws_instance_type" {
  type        = string
  default     = "g5.xlarge"
  description = "A GPU type, so that the base image's driver is the one the bake sees."
}

variable "azure_subscription_id" {
  type    = string
  default = ""
}

variable "azure_resource_group" {
  type    = string
  default = ""
}

variable "azure_location" {
  type    = string
  default = "eastus"
}

variable "azure_vm_size" {
  type    = string
  default = "Standard_NC4as_T4_v3"
}

locals {
  stamp = formatdate("YYYYMMDDhhmmss", timestamp())
  name  = "trainmover-host-${local.stamp}"
}

source "amazon-ebs" "gpu" {
  region        = var.aws_region
  instance_type = var.aws_instance_type
  source_ami_filter {
    filters = {
      name                = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
      architecture        = "x86_64"
      virtualization-type = "hvm"
    }
    owners      = ["amazon"]
    most_recent = true
  }
  ssh_username = "ubuntu"
  ami_name     = local.name
  # The launches require IMDSv2 (cloud.aws's policy): so does the image.
  imds_support = "v2.0"
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = 200
    volume_type           = "gp3"
    delete_on_termination = true
  }
  tags = {
    "trainmover:image" = "host"
  }
}

source "azure-arm" "gpu" {
  use_azure_cli_auth                = true
  subscription_id                   = var.azure_subscription_id
  location                          = var.azure_location
  vm_size                           = var.azure_vm_size
  os_type                           = "Linux"
  image_publisher                   = "microsoft-dsvm"
  image_offer                       = "ubuntu-hpc"
  image_sku                         = "2204"
  managed_image_name                = local.name
  managed_image_resource_group_name = var.azure_resource_group
  azure_tags = {
    "trainmover-image" = "host"
  }
}

build {
  sources = ["source.amazon-ebs.gpu", "source.azure-arm.gpu"]

  provisioner "shell" {
    script          = "${path.root}/bake.sh"
    execute_command = "chmod +x {{ .Path }}; sudo -E bash {{ .Path }}"
  }

  # Azure: generalize the VM before it is captured (its agent's own step).
  provisioner "shell" {
    only            = ["azure-arm.gpu"]
    inline          = ["sudo /usr/sbin/waagent -force -deprovision+user && export HISTSIZE=0 && sync"]
    inline_shebang  = "/bin/sh -x"
    execute_command = "chmod +x {{ .Path }}; {{ .Vars }} sudo -E sh '{{ .Path }}'"
  }
}
